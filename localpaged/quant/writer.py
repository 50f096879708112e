"""Write quantized checkpoints in the AutoGPTQ (v1) / AutoAWQ (GEMM) on-disk formats, with
the config keys transformers and vLLM read (shared/QUANT_FORMATS.md §1.7, §1.10, §2.5)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from localpaged.quant.formats import awq_pack, gptq_pack
from localpaged.quant.gptq import QuantizedLayer

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json", "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt",
)


def quantization_config(method: str, group_size: int, sym: bool, act_order: bool) -> dict[str, Any]:
    """The `quantization_config` dict AutoGPTQ 0.7.1 / AutoAWQ 0.2.9 write."""
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    return {"bits": 4, "group_size": group_size, "damp_percent": 0.01, "desc_act": act_order,
            "static_groups": False, "sym": sym, "true_sequential": True,
            "model_name_or_path": None, "model_file_base_name": "model",
            "is_marlin_format": False, "quant_method": "gptq", "checkpoint_format": "gptq",
            "meta": {"quantizer": ["localpaged:0.1.0"]}}


def layer_tensors(prefix: str, q: QuantizedLayer, method: str, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """One quantized linear's tensors, named `<prefix>.qweight` etc."""
    if method == "awq":
        qweight, qzeros = awq_pack(q.codes, q.zeros)
        out = {"qweight": qweight, "qzeros": qzeros, "scales": q.scales.half()}
    else:
        qweight, qzeros = gptq_pack(q.codes, q.zeros)
        out = {"qweight": qweight, "qzeros": qzeros, "scales": q.scales.half(),
               "g_idx": q.g_idx.to(torch.int32)}
    if bias is not None:
        out["bias"] = bias.detach().half()
    return {f"{prefix}.{k}": v.contiguous() for k, v in out.items()}


def save_quantized(
    model: nn.Module,
    layers: dict[str, QuantizedLayer],
    output: str | Path,
    method: str,
    group_size: int,
    *,
    sym: bool = True,
    act_order: bool = False,
    source: str | Path | None = None,
) -> Path:
    """Write `model` (a transformers model whose linears in `layers` are quantized) to
    `output`: model.safetensors, config.json (+ quantize_config.json for GPTQ), tokenizer
    files copied from `source`."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for prefix, q in layers.items():
        lin = model.get_submodule(prefix)
        tensors.update(layer_tensors(prefix, q, method, lin.bias))
    for name, t in model.state_dict().items():
        prefix = name.rpartition(".")[0]
        if prefix in layers or (tied and name == "lm_head.weight") or name.endswith("inv_freq"):
            continue
        tensors[name] = (t.half() if t.is_floating_point() else t).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    qcfg = quantization_config(method, group_size, sym, act_order)
    config = model.config.to_dict()
    config["quantization_config"] = qcfg
    config["torch_dtype"] = config["dtype"] = "float16"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")
    if method == "gptq":
        (out / "quantize_config.json").write_text(json.dumps(qcfg, indent=2), encoding="utf-8")
    if source is not None:
        for name in TOKENIZER_FILES:
            if (Path(source) / name).exists():
                shutil.copy(Path(source) / name, out / name)
    return out
