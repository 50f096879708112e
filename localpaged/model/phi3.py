"""Phi-3 and Phi-4-mini (`Phi3ForCausalLM`): the Llama layers, with three differences.

- The checkpoint holds q/k/v as one `qkv_proj` (q rows, then k, then v) and gate/up as one
  `gate_up_proj` (gate rows, then up): the model is built with those fused layers, which the
  Llama model makes for inference anyway, so HF, AWQ/GPTQ and GGUF tensors load by name
  (GGUF `attn_qkv`, and `ffn_up` holding gate and up).
- Partial rotary (Phi-4-mini: the first 3/4 of each head) and LongRoPE live in the rotary
  table (`localpaged.model.rope`, whose docstring gives the short/long rule).
- Its GGUF (`phi3`) names the rotary width `rope.dimension_count` (not head_dim) and carries
  LongRoPE as two tensors, `rope_factors_long` / `rope_factors_short`, beside
  `rope.scaling.original_context_length` and `rope.scaling.attn_factor` (`gguf_rope_config`).
  Its eos is `<|endoftext|>` alone while answers end with `<|end|>` (llama.cpp stops there by
  the token's text): `gguf_turn_end_ids` adds it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from localpaged.model.config import ModelConfig
from localpaged.model.llama import LlamaForCausalLM

# GGUF tensors that hold the LongRoPE factors (rebuilt into the config, not weights)
GGUF_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


class Phi3ForCausalLM(LlamaForCausalLM):
    """`LlamaForCausalLM` whose layers are fused as Phi-3's checkpoint stores them."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__(config, dtype, device)
        c, kw = config, dict(dtype=dtype, device=device)
        qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            del attn.q_proj, attn.k_proj, attn.v_proj
            attn.qkv_proj = nn.Linear(c.hidden_size, qkv_rows, bias=c.qkv_bias, **kw)
            del mlp.gate_proj, mlp.up_proj
            mlp.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size,
                                         bias=c.mlp_bias, **kw)


def gguf_rope_config(config: dict[str, Any], metadata: dict[str, Any],
                     tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    """`config` (an HF config dict read from a `phi3` GGUF's common keys) with Phi-3's rope:
    head_dim from the sizes (`rope.dimension_count` is the rotary width), the partial rotary
    factor, and LongRoPE from the factor tensors, as llama.cpp's converter writes them.
    `tensors`: the factor tensors present, by GGUF name."""
    out = dict(config)
    key_length = metadata.get("phi3.attention.key_length")
    head_dim = int(key_length) if key_length else out["hidden_size"] // out["num_attention_heads"]
    out["head_dim"] = head_dim
    rot = metadata.get("phi3.rope.dimension_count")
    if rot and int(rot) != head_dim:
        out["partial_rotary_factor"] = int(rot) / head_dim
    long, short = (tensors.get(name) for name in GGUF_ROPE_FACTORS)
    if long is None or short is None:
        return out
    orig = metadata.get("phi3.rope.scaling.original_context_length")
    if not orig:
        raise ValueError("phi3 GGUF with rope factors but no rope.scaling.original_context_length")
    out["original_max_position_embeddings"] = int(orig)
    scaling: dict[str, Any] = {"rope_type": "longrope",
                               "long_factor": [float(x) for x in np.asarray(long).ravel()],
                               "short_factor": [float(x) for x in np.asarray(short).ravel()]}
    attn = metadata.get("phi3.rope.scaling.attn_factor")
    if attn is not None:
        scaling["attention_factor"] = float(attn)
    out["rope_scaling"] = scaling
    return out


def gguf_turn_end_ids(hf_tokenizer: Any) -> list[int]:
    """The id of `<|end|>`, where the tokenizer of a `phi3` GGUF has it."""
    backend = getattr(hf_tokenizer, "backend", None)  # a SavedTokenizer's
    if not hasattr(backend, "token_to_id"):  # transformers': its `backend` is a name
        backend = hf_tokenizer.backend_tokenizer
    token_id = backend.token_to_id("<|end|>")
    return [] if token_id is None else [int(token_id)]
