"""Run GPTQ or AWQ over a transformers Llama-family model, one decoder layer at a time, on
calibration token ids. Returns the quantized layers by HF name (the model is modified in
place: AWQ folds its scales into norms / previous linears)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from localpaged.quant.awq import apply_clip, awq_quantize, search_clip, search_scale
from localpaged.quant.gptq import QuantizedLayer, gptq_quantize

MIN_CALIB_TOKENS = 256
# Sub-groups quantized in order within a layer (GPTQ's "true sequential").
SEQUENTIAL = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)
Progress = Callable[[str], None]


class _Stop(Exception):
    pass


def calibration_ids(ids: Sequence[int], seqlen: int) -> torch.Tensor:
    """Token ids cut into `[n, seqlen]` samples; refuses fewer than MIN_CALIB_TOKENS."""
    n = len(ids) // seqlen
    if n * seqlen < MIN_CALIB_TOKENS or n == 0:
        raise ValueError(
            f"too little calibration data: {len(ids)} tokens make {n} samples of {seqlen}; "
            f"need at least {max(MIN_CALIB_TOKENS, seqlen)} tokens"
        )
    return torch.tensor(list(ids[: n * seqlen]), dtype=torch.long).view(n, seqlen)


def _layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers


@torch.no_grad()
def _layer_inputs(model: nn.Module, ids: torch.Tensor) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Inputs of decoder layer 0 for each sample (and the shared keyword arguments)."""
    captured: list[torch.Tensor] = []
    kwargs: dict[str, Any] = {}

    def hook(_m: nn.Module, args: tuple, kw: dict[str, Any]) -> None:
        captured.append(args[0] if args else kw["hidden_states"])
        kwargs.update({k: v for k, v in kw.items() if k != "hidden_states"})
        raise _Stop

    handle = _layers(model)[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for row in ids:
            with contextlib.suppress(_Stop):
                model(row.unsqueeze(0), use_cache=False)
    finally:
        handle.remove()
    kwargs["use_cache"] = False
    kwargs.pop("past_key_values", None)
    kwargs.pop("cache", None)
    return captured, kwargs


def _run_layer(layer: nn.Module, hs: list[torch.Tensor], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    outs = []
    for h in hs:
        out = layer(h, **kwargs)
        outs.append(out[0] if isinstance(out, tuple) else out)
    return outs


def _hessians(layer: nn.Module, names: Sequence[str], hs: list[torch.Tensor], kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Sum of x x^T over every calibration row reaching each named linear."""
    hess: dict[str, torch.Tensor] = {}
    handles = []
    for name in names:
        lin = layer.get_submodule(name)
        hess[name] = torch.zeros(lin.in_features, lin.in_features)

        def hook(_m: nn.Module, args: tuple, _out: Any, name: str = name) -> None:
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            hess[name] += x.t() @ x

        handles.append(lin.register_forward_hook(hook))
    try:
        _run_layer(layer, hs, kwargs)
    finally:
        for h in handles:
            h.remove()
    return hess


def _inputs(layer: nn.Module, names: Sequence[str], hs: list[torch.Tensor], kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Input rows `[n, T, K]` of each named linear."""
    got: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    handles = [
        layer.get_submodule(n).register_forward_hook(
            lambda _m, args, _o, n=n: got[n].append(args[0].detach())
        )
        for n in names
    ]
    try:
        _run_layer(layer, hs, kwargs)
    finally:
        for h in handles:
            h.remove()
    return {n: torch.cat(v) for n, v in got.items()}


def _with_weights(linears: Sequence[nn.Linear], fn: Callable[[], torch.Tensor]) -> Callable[[Sequence[torch.Tensor]], torch.Tensor]:
    def run(ws: Sequence[torch.Tensor]) -> torch.Tensor:
        saved = [lin.weight.data for lin in linears]
        try:
            for lin, w in zip(linears, ws):
                lin.weight.data = w.to(lin.weight.dtype)
            return fn()
        finally:
            for lin, w in zip(linears, saved):
                lin.weight.data = w
    return run


@torch.no_grad()
def _awq_layer(layer: nn.Module, hs: list[torch.Tensor], kwargs: dict[str, Any], gs: int) -> dict[str, QuantizedLayer]:
    attn, mlp = layer.self_attn, layer.mlp
    feats = _inputs(layer, ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"), hs, kwargs)
    attn_kw = {k: v for k, v in kwargs.items() if k in ("position_embeddings", "attention_mask")}
    x_qkv, x_mlp = feats["self_attn.q_proj"], feats["mlp.gate_proj"]
    steps: list[tuple[nn.Module, list[nn.Linear], torch.Tensor, Callable[[], torch.Tensor]]] = [
        (layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], x_qkv,
         lambda: attn(hidden_states=x_qkv, **attn_kw)[0]),
        (layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], x_mlp, lambda: mlp(x_mlp)),
        (mlp.up_proj, [mlp.down_proj], feats["mlp.down_proj"], lambda: mlp.down_proj(feats["mlp.down_proj"])),
    ]
    if attn.v_proj.weight.shape == attn.o_proj.weight.shape:  # not with GQA (AutoAWQ's rule)
        x_o = feats["self_attn.o_proj"]
        steps.insert(1, (attn.v_proj, [attn.o_proj], x_o, lambda: attn.o_proj(x_o)))
    scaled_inputs: dict[int, torch.Tensor] = {}
    for prev, linears, x, fn in steps:
        s = search_scale(x, [lin.weight for lin in linears], _with_weights(linears, fn), gs)
        # fold: prev op's output channels / s, the linears' input channels * s
        prev.weight.div_(s.view(-1, *([1] * (prev.weight.dim() - 1))).to(prev.weight.dtype))
        if getattr(prev, "bias", None) is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
        for lin in linears:
            lin.weight.mul_(s.to(lin.weight.dtype))
            scaled_inputs[id(lin)] = x / s.to(x.dtype)
    out: dict[str, QuantizedLayer] = {}
    for name in (n for group in SEQUENTIAL for n in group):
        lin = layer.get_submodule(name)
        w = lin.weight.data.float()
        if name not in ("self_attn.q_proj", "self_attn.k_proj"):  # AutoAWQ skips q/k clipping
            x = scaled_inputs.get(id(lin), feats.get(name))
            w = apply_clip(w, search_clip(x, w, gs), gs)
        out[name] = q = awq_quantize(w, gs)
        lin.weight.data = q.dequantize().to(lin.weight.dtype)
    return out


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    ids: torch.Tensor,
    method: str,
    group_size: int,
    *,
    sym: bool = True,
    act_order: bool = False,
    mse: bool = False,
    progress: Progress = print,
) -> dict[str, QuantizedLayer]:
    """Quantize every decoder-layer linear of a transformers Llama-family `model` (float32,
    modified in place to hold the dequantized weights) on calibration ids `[n, T]`."""
    if method not in ("gptq", "awq"):
        raise ValueError(f"method={method!r}: supported are 'gptq', 'awq'")
    model.eval()
    hs, kwargs = _layer_inputs(model, ids)
    result: dict[str, QuantizedLayer] = {}
    layers = _layers(model)
    for i, layer in enumerate(layers):
        if method == "awq":
            quantized = _awq_layer(layer, hs, kwargs, group_size)
        else:
            quantized = {}
            for group in SEQUENTIAL:
                hess = _hessians(layer, group, hs, kwargs)
                for name in group:
                    lin = layer.get_submodule(name)
                    q = gptq_quantize(lin.weight.data, hess[name], group_size, sym, act_order, mse=mse)
                    lin.weight.data = q.dequantize().to(lin.weight.dtype)
                    quantized[name] = q
        out = _run_layer(layer, hs, kwargs)  # through the quantized layer, as the next sees it
        for name, q in quantized.items():
            result[f"model.layers.{i}.{name}"] = q
        hs = out
        progress(f"{method}: layer {i + 1}/{len(layers)} quantized")
    return result

