"""ModelConfig: the fields of an HF config.json that the model, loader and engine need.

Reads both transformers-4 style configs (`rope_theta`, `rope_scaling`, `torch_dtype`) and
transformers-5 style ones (`rope_parameters` holding rope_type/rope_theta/factors, `dtype`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                           "Gemma3ForCausalLM", "Phi3ForCausalLM")

# Keys of a rope dict that are not scaling parameters.
_ROPE_NON_SCALING = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


@dataclass
class ModelConfig:
    """Architecture hyper-parameters of one Llama-family checkpoint."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary (Qwen3)
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    quantization_config: dict[str, Any] | None = None
    sliding_window: int | None = None  # read, not applied: attention here is full causal
    # A mixture of experts (Qwen3-MoE): `num_experts` MLPs of `moe_intermediate_size`, the
    # router's top `num_experts_per_tok` per token, in layers i with (i + 1) % step == 0
    # that are not in `mlp_only_layers`; the others keep one dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Rotary over the first head_dim * partial_rotary_factor dims of each head (Phi-4-mini)
    partial_rotary_factor: float = 1.0
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The config's eos id(s) as a tuple (empty when unset)."""
        eos = self.eos_token_id
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` holds the experts (else one dense MLP)."""
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    @property
    def rotary_dim(self) -> int:
        """The dims of each head that rotary rotates (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope_type(self) -> str:
        return (self.rope_scaling or {}).get("rope_type", "default")

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed config.json (either transformers major version's keys)."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(cfg.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {arch!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        rope_theta, rope_scaling = _rope_fields(_gemma3_global_rope(cfg, arch))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        is_qwen3 = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        # transformers 5 writes num_local_experts, 4 num_experts
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        moe = arch == "Qwen3MoeForCausalLM" and experts > 0
        is_phi3 = arch == "Phi3ForCausalLM"
        if is_phi3:
            rope_scaling = _phi3_rope_scaling(cfg, rope_scaling)
        attention_bias = bool(cfg.get("attention_bias", False)) and not is_phi3
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch == "Gemma3ForCausalLM")),
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=False if is_qwen2 or is_qwen3 or is_phi3 else bool(cfg.get("mlp_bias", False)),
            qk_norm=is_qwen3 or arch == "Gemma3ForCausalLM",
            torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            quantization_config=cfg.get("quantization_config"),
            sliding_window=_sliding_window(cfg, arch),
            num_experts=experts if moe else 0,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0) if moe else 0,
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0) if moe else 0,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
            partial_rotary_factor=_partial_rotary_factor(cfg),
            raw=dict(cfg),
        )

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> ModelConfig:
        """Read `folder/config.json`."""
        with open(Path(folder) / "config.json", encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


def _sliding_window(cfg: dict[str, Any], arch: str) -> int | None:
    """Mistral's window, or Qwen2's / Qwen3's when use_sliding_window is on; None otherwise."""
    window = cfg.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and not cfg.get(
            "use_sliding_window", False):
        return None
    return int(window) if window else None


def _gemma3_global_rope(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """Gemma 3's config as one rope: its global layers' (rope_theta, 1e6 by default, and the
    scaling), which the fields name; the local layers' base is read by model.gemma3."""
    if arch != "Gemma3ForCausalLM":
        return cfg
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        return {**cfg, "rope_parameters": params["full_attention"]}
    return {"rope_theta": 1_000_000.0, **cfg}


def _arch_from_model_type(model_type: str | None) -> str:
    names = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
             "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
             "qwen3_moe": "Qwen3MoeForCausalLM",
             "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
    return names.get(model_type or "", f"<model_type {model_type!r}>")


def _rope_fields(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalized rope_scaling or None) from either config style.

    The normalized dict always has "rope_type" (never the legacy "type") and no rope_theta;
    a "default" rope gives None.
    """
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" not in params and "rope_type" not in params:
        params = None  # a per-layer-type dict (not used by this family)
    theta = cfg.get("rope_theta")
    if params and params.get("rope_theta") is not None:
        theta = params["rope_theta"]
    scaling = cfg.get("rope_scaling") or params or None
    if theta is None:
        theta = 10000.0
    if not scaling:
        return float(theta), None
    out = {k: v for k, v in scaling.items() if k not in _ROPE_NON_SCALING}
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return float(theta), None
    out["rope_type"] = rope_type
    return float(theta), out


def _partial_rotary_factor(cfg: dict[str, Any]) -> float:
    """The config's partial_rotary_factor: top level (transformers 4) or in rope_parameters."""
    params = cfg.get("rope_parameters")
    nested = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    factor = cfg.get("partial_rotary_factor", nested)
    return float(factor) if factor is not None else 1.0


def _phi3_rope_scaling(cfg: dict[str, Any], scaling: dict[str, Any] | None
                       ) -> dict[str, Any] | None:
    """Phi-3's rope dict as transformers reads it: the legacy names "su" and "yarn" mean
    longrope, and the top-level original_max_position_embeddings (Phi3Config's default 4096
    when absent) wins over the dict's."""
    if scaling is None:
        return None
    out = dict(scaling)
    if out.get("rope_type") in ("su", "yarn"):
        out["rope_type"] = "longrope"
    if out.get("rope_type") == "longrope":
        out["original_max_position_embeddings"] = int(
            cfg.get("original_max_position_embeddings") or 4096)
    return out
