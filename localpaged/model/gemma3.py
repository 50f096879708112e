"""Gemma 3 text models (`Gemma3ForCausalLM`, GGUF `gemma3`) over the flat, paged batch of
localpaged.model.llama, as transformers computes them.

What differs from Llama: RMSNorms scale by (1 + w), in float32 before rounding; a norm before
and after both attention and the MLP; GeGLU (tanh GELU); embeddings times sqrt(hidden), that
factor rounded to the model's dtype; q/k RMSNorm per head; attention scaled by
query_pre_attn_scalar ** -0.5; local layers with a sliding window and their own rope base
(rope_local_base_freq, unscaled) between global ones (5:1 in the released models: layer i is
global when (i + 1) % 6 == 0), which take rope_theta and the rope scaling.

Sliding window: masked exactly in every attention path (`kernels.attention.paged_attention`'s
`window`); the paged cache keeps the whole context for the local layers too. The cost is the
local layers' KV past their window: for gemma3:1b (26 layers, 22 local, window 512, one KV head
of 256) 1 KiB per token and layer in bf16, so a 32k-token chat holds 22 x (32768 - 512) KiB =
693 MiB more than windowed local layers would (832 MiB in all instead of 139 MiB); for
gemma3:4b (34 layers, 29 local, window 1024, 4 KV heads: 4 KiB per token and layer) 3.6 GiB
more (4.25 GiB instead of 0.74 GiB). Chats within the window pay nothing; the time of a local
layer follows its window (the attention paths read only the blocks it reaches).

The native CPU decode layer (kernels.decode_layer) computes Llama's norms and SiLU MLP: it is
refused for this family; the torch layers run, with the CPU matmul kernels.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from localpaged.kernels import AttentionMetadata, apply_rotary, paged_attention, write_kv
from localpaged.model.config import ModelConfig
from localpaged.model.llama import MLP, Attention, KVCache, LlamaForCausalLM
from localpaged.model.rope import build_cos_sin

ARCHITECTURE = "Gemma3ForCausalLM"
SLIDING_WINDOW_PATTERN = 6  # llama.cpp's and transformers' default: 5 local layers, 1 global


@dataclass(frozen=True)
class Gemma3Options:
    """The Gemma-only fields of a config (HF config.json or a GGUF's `hf_config()`)."""

    sliding: tuple[bool, ...]  # per layer: a local (sliding-window) layer
    sliding_window: int
    local_rope_theta: float
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None

    @classmethod
    def from_config(cls, config: ModelConfig) -> Gemma3Options:
        raw = config.raw
        for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
            if raw.get(key):
                raise ValueError(f"Gemma 3 with {key}={raw[key]!r} is not supported")
        act = raw.get("hidden_activation") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"Gemma 3 with hidden_activation {act!r} is not supported "
                             "(supported: gelu_pytorch_tanh)")
        n = config.num_layers
        types = raw.get("layer_types")
        if types:
            sliding = tuple(t == "sliding_attention" for t in types[:n])
        else:
            pattern = int(raw.get("sliding_window_pattern") or SLIDING_WINDOW_PATTERN)
            sliding = tuple(bool((i + 1) % pattern) for i in range(n))
        window = raw.get("sliding_window")
        if not window:
            sliding, window = (False,) * n, 0
        local = raw.get("rope_local_base_freq")
        params = raw.get("rope_parameters")
        if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
            local = params["sliding_attention"].get("rope_theta", local)
        scalar = raw.get("query_pre_attn_scalar") or config.head_dim
        softcap = raw.get("final_logit_softcapping")
        return cls(sliding, int(window), float(local or 10000.0), float(scalar),
                   float(softcap) if softcap else None)


class GemmaRMSNorm(nn.Module):
    """HF's Gemma3RMSNorm: x / rms(x) * (1 + w), in float32, rounded to x's dtype once. The
    weight is HF's (zero-centred); llama.cpp files store 1 + w (the GGUF loader subtracts 1)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(Attention):
    """Llama's attention (q/k/v/o, joined for inference) with Gemma's per-head norms, its query
    scaling, and on local layers a sliding window and the local rope table."""

    def __init__(self, config: ModelConfig, opts: Gemma3Options, local: bool,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__(config, dtype, device)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
        self.scale = opts.query_pre_attn_scalar**-0.5
        self.window = opts.sliding_window if local else None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t, hd = x.shape[0], self.head_dim
        if self.qkv_proj is not None:
            nq, nkv = self.num_heads * hd, self.num_kv_heads * hd
            q, k, v = self.qkv_proj(x).split((nq, nkv, nkv), dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = self.q_norm(q.reshape(t, self.num_heads, hd))
        k = self.k_norm(k.reshape(t, self.num_kv_heads, hd))
        v = v.reshape(t, self.num_kv_heads, hd)
        # the rotary ops keep the step's cos/sin rows in the cache dict: one per table
        cache = meta.derived if self.window is None else meta.memo("gemma3.local_rotary", dict)
        q, k = apply_rotary(q, k, positions, cos_sin, cache)
        k_cache, v_cache = kv_cache
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta, self.scale, window=self.window)
        return self.o_proj(out.reshape(t, self.num_heads * hd))


class Gemma3MLP(MLP):
    """gelu_tanh(gate) * up, then down."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, opts: Gemma3Options, local: bool,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.local = local
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.self_attn = Gemma3Attention(config, opts, local, dtype, device)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.mlp = Gemma3MLP(config, dtype, device)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), positions, cos_sin, kv_cache, meta)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig, opts: Gemma3Options, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        weight = torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, opts, local, dtype, device) for local in opts.sliding)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


def local_rope_config(config: ModelConfig, opts: Gemma3Options) -> ModelConfig:
    """The config whose rope table the local layers use: their base, no scaling."""
    return dataclasses.replace(config, rope_theta=opts.local_rope_theta, rope_scaling=None)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """The interface of LlamaForCausalLM (loading by HF names, joined projections, paged KV
    caches, `compute_logits`) for Gemma 3. Two rope tables: `cos_sin` (global layers) and
    `cos_sin_local`."""

    native_decode_supported = False  # kernels.decode_layer computes Llama's layer only

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        nn.Module.__init__(self)  # not LlamaForCausalLM's: it would build Llama layers
        self.config = config
        self.dtype = dtype
        self.options = Gemma3Options.from_config(config)
        self.model = Gemma3Model(config, self.options, dtype, device)
        self.lm_head = nn.Linear(
            config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device
        )
        self.tie_weights()
        rope_device = "cpu" if torch.device(device).type == "meta" else device
        self.register_buffer("cos_sin", build_cos_sin(config, rope_device), persistent=False)
        self.register_buffer("cos_sin_local", self._local_table(rope_device), persistent=False)
        self.cpu_decode: Any = None  # never set: see native_decode_supported

    def _local_table(self, device: torch.device | str) -> torch.Tensor:
        return build_cos_sin(local_rope_config(self.config, self.options), device)

    def materialize(self, device: torch.device | str) -> Gemma3ForCausalLM:
        super().materialize(device)
        self.cos_sin_local = self._local_table(device)
        return self

    def embed_scale(self, dtype: torch.dtype) -> torch.Tensor:
        """sqrt(hidden) as HF applies it: a float32 scalar rounded to the embeddings' dtype."""
        return torch.tensor(math.sqrt(self.config.hidden_size), dtype=torch.float32).to(dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        h = h * self.embed_scale(h.dtype).to(h.device)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            table = self.cos_sin_local if layer.local else self.cos_sin
            h = layer(h, positions, table, kv_cache, meta)
        return self.model.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.options.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
