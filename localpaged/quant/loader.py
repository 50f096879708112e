"""Load AWQ / GPTQ checkpoints into the model room's model: swap its `nn.Linear`s for
`QuantLinear`s by name, then fill them from HF-named tensors (`<prefix>.qweight`, ...)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from localpaged.quant.formats import QuantSpec, awq_to_int4, gptq_to_int4, parse_quant_config
from localpaged.quant.linear import QuantLinear

_QUANT_LEAVES = ("qweight", "qzeros", "scales", "g_idx", "bias")
_REQUIRED = ("qweight", "qzeros", "scales")


def quantized_linear_names(model: nn.Module, spec: QuantSpec) -> list[str]:
    """Names of the `nn.Linear`s a checkpoint of `spec` stores quantized."""
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if name == "lm_head" and not spec.lm_head:
            continue
        if any(skip in name for skip in spec.modules_to_not_convert):
            continue
        names.append(name)
    return names


def quantize_modules(model: nn.Module, quantization_config: dict[str, Any]) -> list[str]:
    """Replace the quantized `nn.Linear`s of `model` (usually on the meta device) with empty
    `QuantLinear`s of the same shape, dtype and device. Returns their names."""
    spec = parse_quant_config(quantization_config)
    names = quantized_linear_names(model, spec)
    for name in names:
        linear = model.get_submodule(name)
        parent, _, leaf = name.rpartition(".")
        layer = QuantLinear(
            linear.in_features, linear.out_features, linear.bias is not None,
            linear.weight.dtype, linear.weight.device,
        )
        setattr(model.get_submodule(parent) if parent else model, leaf, layer)
    return names


def _finish(
    model: nn.Module, prefix: str, tensors: dict[str, torch.Tensor], spec: QuantSpec, device: torch.device
) -> None:
    layer: QuantLinear = model.get_submodule(prefix)
    to_int4 = gptq_to_int4 if spec.method == "gptq" else awq_to_int4
    w = to_int4(prefix, tensors, spec, layer.in_features, layer.out_features)
    layer.load(w, None, device)
    if "bias" in tensors:
        _load_bias(layer, prefix, tensors["bias"])


def _load_bias(layer: QuantLinear, prefix: str, bias: torch.Tensor) -> None:
    name = f"{prefix}.bias"
    if tuple(bias.shape) != (layer.out_features,):
        raise ValueError(f"tensor {name!r}: expected shape {(layer.out_features,)}, found {tuple(bias.shape)}")
    if layer.bias is None:
        if bool(bias.any()):  # AutoGPTQ writes all-zero biases for bias-free layers: skip those
            raise ValueError(f"tensor {name!r} is non-zero but the model's layer has no bias")
        return
    with torch.no_grad():
        layer.bias.copy_(bias)


def load_quantized_weights(
    model: nn.Module, quantization_config: dict[str, Any], weights: Iterable[tuple[str, torch.Tensor]]
) -> nn.Module:
    """Fill a materialized model whose linears `quantize_modules` replaced, checking every
    tensor's presence and shape."""
    spec = parse_quant_config(quantization_config)
    targets = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    int8_tables = _int8_tables_wanted(model, spec)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    done: set[str] = set()
    loaded: set[str] = set()
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and tied):
            continue
        if prefix in targets:
            if leaf not in _QUANT_LEAVES:
                raise ValueError(f"unexpected tensor {name!r} for quantized layer {prefix!r} "
                                 f"(expected {', '.join(_QUANT_LEAVES)})")
            if leaf == "bias":
                loaded.add(name)  # copied now, or with the layer's other tensors (or refused)
            if prefix in done:
                if leaf != "bias":
                    raise ValueError(f"tensor {name!r} appears twice")
                _load_bias(model.get_submodule(prefix), prefix, tensor)
                continue
            pending.setdefault(prefix, {})[leaf] = tensor
            got = pending[prefix]
            if all(k in got for k in _REQUIRED) and (spec.method == "awq" or "g_idx" in got):
                _finish(model, prefix, pending.pop(prefix), spec, device)
                done.add(prefix)
            continue
        if name in int8_tables and name in params:
            from localpaged.quant.ggml_int8 import Int8Blocks

            install_int8(model, name, Int8Blocks.q8_0_of(tensor), tied)
            loaded.add(name)
            continue
        param = params.get(name)
        if param is None:
            raise ValueError(f"unexpected tensor {name!r} (shape {tuple(tensor.shape)})")
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"tensor {name!r}: expected shape {tuple(param.shape)}, "
                             f"found {tuple(tensor.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(name)
    for prefix, got in pending.items():
        missing = [k for k in _REQUIRED if k not in got]
        if missing:
            layer = model.get_submodule(prefix)
            raise ValueError(_missing_message(prefix, missing[0], layer, spec))
        _finish(model, prefix, got, spec, device)
        done.add(prefix)
    for prefix in sorted(targets - done):
        raise ValueError(_missing_message(prefix, "qweight", model.get_submodule(prefix), spec))
    for prefix in sorted(targets):
        layer = model.get_submodule(prefix)
        if layer.bias is not None and f"{prefix}.bias" not in loaded:
            raise ValueError(f"tensor '{prefix}.bias' is missing: expected shape {(layer.out_features,)}")
    for name in params:
        if name not in loaded:
            raise ValueError(f"tensor {name!r} is missing: expected shape {tuple(params[name].shape)}")
    return model


def _int8_tables_wanted(model: nn.Module, spec: QuantSpec) -> set[str]:
    """The 16-bit token embedding and output layer of a checkpoint whose matrices are 4-bit,
    where the model computes in float32 on a CPU whose kernels round activations to int8:
    kept as Q8_0 blocks (llama.cpp's usual output type) rather than widened to float32, which
    would be twice the file's bytes in memory and, for the head, read on every decode step."""
    from localpaged.quant import cpu_w4
    from localpaged.quant.q8_linear import fits_kernel

    dtype = getattr(model, "dtype", None)
    embed = model.get_submodule("model.embed_tokens")
    if (dtype != torch.float32 or embed.weight.device.type != "cpu" or not cpu_w4.available()
            or not cpu_w4.int8_activations()):
        return set()
    names = set()
    for name, module in (("model.embed_tokens.weight", embed),
                         ("lm_head.weight", getattr(model, "lm_head", None))):
        shape = tuple(getattr(module, "weight", torch.empty(0, 0)).shape)
        if (name != "lm_head.weight" or not spec.lm_head) and len(shape) == 2 and fits_kernel(
                (shape[0], shape[1]), 32):
            names.add(name)
    return names


def _missing_message(prefix: str, leaf: str, layer: QuantLinear, spec: QuantSpec) -> str:
    k, n = layer.in_features, layer.out_features
    groups = -(-k // (k if spec.group_size == -1 else spec.group_size))
    if spec.method == "gptq":
        shapes = {"qweight": (k // 8, n), "qzeros": (groups, n // 8), "scales": (groups, n)}
    else:
        shapes = {"qweight": (k, n // 8), "qzeros": (groups, n // 8), "scales": (groups, n)}
    return f"tensor '{prefix}.{leaf}' is missing: expected shape {shapes[leaf]}"


def install_int4(model: nn.Module, name: str, weight: Any, tied: bool = False) -> None:
    """Put a ready 4-bit weight (`Int4Weight`, or a GGUF matrix's `GgmlInt4Weight`) named
    `<prefix>.weight` into `model` in place of the `nn.Linear` at `<prefix>`. A bias the
    linear has stays shared with the model's parameters (so it still loads by name). A token
    embedding stays 4-bit where the own CPU kernel takes it (`QuantEmbedding`, also the
    output layer when `tied`), else it is stored dense."""
    from localpaged.quant import cpu_w4, w6_linear
    from localpaged.quant.ggml_int4 import GgmlInt4Weight
    from localpaged.quant.layout import Int4Weight

    prefix, _, leaf = name.rpartition(".")
    linear = model.get_submodule(prefix)
    if leaf != "weight" or not isinstance(weight, (Int4Weight, GgmlInt4Weight)):
        raise ValueError(f"tensor {name!r}: a 4-bit weight only fits a module's .weight")
    if not isinstance(linear, nn.Linear):  # e.g. a Q4 token embedding: stored dense
        param = linear.weight
        if tuple(param.shape) != (weight.out_features, weight.in_features):
            raise ValueError(f"tensor {name!r}: expected shape {tuple(param.shape)}, found "
                             f"{(weight.out_features, weight.in_features)}")
        if (isinstance(linear, nn.Embedding) and param.device.type == "cpu"
                and w6_linear.four_bit_wanted(weight, param.dtype)):
            six = w6_linear.from_four_bit(weight)
            model.model.embed_tokens = w6_linear.W6Embedding(six, param.dtype)
            if tied:
                model.lm_head = six
            return
        if isinstance(linear, nn.Embedding) and param.device.type == "cpu" and cpu_w4.available():
            from localpaged.quant.linear import QuantEmbedding

            table = QuantLinear.from_int4(weight, None, param.dtype, param.device)
            if table.w4_packed is not None and table.perm is None:
                model.model.embed_tokens = QuantEmbedding(table, param.dtype)
                if tied:
                    model.lm_head = table
                return
        with torch.no_grad():
            param.copy_(weight.dequantize())
        return
    if (weight.out_features, weight.in_features) != (linear.out_features, linear.in_features):
        raise ValueError(f"tensor {name!r}: expected shape {tuple(linear.weight.shape)}, found "
                         f"{(weight.out_features, weight.in_features)}")
    layer: nn.Module
    if linear.weight.device.type == "cpu" and w6_linear.four_bit_wanted(weight, linear.weight.dtype):
        layer = w6_linear.from_four_bit(weight)  # Q4_0 / Q4_K in (nearly) the file's bits
    else:
        layer = QuantLinear.from_int4(weight, None, linear.weight.dtype, linear.weight.device)
    if linear.bias is not None:
        layer.bias = linear.bias
    parent, _, child = prefix.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, layer)


def install_int8(model: nn.Module, name: str, weight: Any, tied: bool) -> None:
    """Put a GGUF matrix kept as int8 blocks (`ggml_int8.Int8Blocks`), or in the 6-bit layout
    where it takes that (`w6_linear.wanted`), named `<prefix>.weight` into `model`: the token
    embedding as `Q8Embedding` / `W6Embedding` (also the output layer when `tied`), a linear
    layer as `Q8Linear` / `W6Linear` (its bias stays shared with the model's parameters)."""
    from localpaged.quant import w6_linear
    from localpaged.quant.ggml_int8 import GgmlInt8Weight
    from localpaged.quant.q8_linear import Q8Embedding, Q8Linear

    prefix, _, leaf = name.rpartition(".")
    old = model.get_submodule(prefix)
    want = ((old.num_embeddings, old.embedding_dim) if isinstance(old, nn.Embedding)
            else (old.out_features, old.in_features) if isinstance(old, nn.Linear) else None)
    if leaf != "weight" or want is None:
        raise ValueError(f"tensor {name!r}: int8 blocks fit only a linear or embedding weight")
    if tuple(weight.shape) != want:
        raise ValueError(f"tensor {name!r}: expected shape {want}, found {tuple(weight.shape)}")
    six = isinstance(weight, GgmlInt8Weight) and w6_linear.wanted(weight.type_name, weight.shape)
    layer: nn.Module = w6_linear.W6Linear.from_gguf(weight) if six else Q8Linear.from_blocks(weight)
    if isinstance(old, nn.Embedding):
        table = w6_linear.W6Embedding if six else Q8Embedding
        model.model.embed_tokens = table(layer, old.weight.dtype)  # type: ignore[arg-type]
        if tied:
            model.lm_head = layer
        return
    layer.bias = old.bias
    parent, _, child = prefix.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, layer)
