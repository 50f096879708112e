"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) over a flat, unpadded token batch
with a paged KV cache.

Module and parameter names follow HF's (`model.layers.N.self_attn.q_proj`, `lm_head`, ...) so
checkpoints load by name and the quant room can swap `nn.Linear`s for quantized ones by name.
Sliding-window attention (Mistral v0.1, Qwen2 with use_sliding_window) is not applied.
"""

from __future__ import annotations

import math
import mmap
from typing import Any

import torch
from torch import nn

from localpaged.kernels import (
    AttentionMetadata,
    apply_rotary,
    paged_attention,
    rms_norm,
    silu_and_mul,
    write_kv,
)
from localpaged.kernels.attention import select_requests, token_rows
from localpaged.kernels.backend import use_triton_on
from localpaged.model.config import ModelConfig
from localpaged.model.rope import build_cos_sin, table_offset

KVCache = tuple[torch.Tensor, torch.Tensor]
# Prompt chunks take the native decode plan, one row per token (see `_run_mixed`), up to
# (tokens, tokens x context) by the model's dtype; longer ones the torch layers, whose
# batched attention scales better with the context. The plan saves the torch layers' fixed
# cost (~15 ms a step on SmolLM2) and their elementwise ops. bfloat16 on AMX: the plan's
# attention costs ~4x torch's per query and context token (torch's is AMX's), so only
# short chunks (16 tokens at context 2000, 64 at 500). float32 (the int8 builds): a 512-token
# prompt reads 901 against 768 tok/s through the torch layers (SmolLM2, avx2; 1698 against
# 1196 avx512vnni), a 2048-token one 573 against 627 (avx2), so chunks up to context 1024.
NATIVE_LIMITS: dict[torch.dtype, tuple[int, int]] = {
    torch.bfloat16: (64, 32768),
    torch.float32: (512, 512 * 1024),
}


def native_limits(dtype: torch.dtype) -> tuple[int, int]:
    """`NATIVE_LIMITS` for a model computing in `dtype` on this CPU. bfloat16 without AMX
    (AVX512-BF16: AMD Zen 4/5) takes the float32 limits: there torch's bf16 attention has no
    tiles (SmolLM2 on Zen 5: ~70 GFLOP/s), and the plan read a 128 / 512 / 2048-token prompt
    at 2617 / 2070 / 959 tok/s against 1953 / 1460 / 851 with the short limits."""
    from localpaged.kernels import cpu_isa

    if dtype == torch.bfloat16 and cpu_isa.chosen() != "amx":
        dtype = torch.float32
    return NATIVE_LIMITS.get(dtype, NATIVE_LIMITS[torch.bfloat16])


def fuse_linears(layers: list[nn.Module]) -> nn.Module:
    """One layer whose output is the outputs of `layers` (same input) concatenated.
    Raises ValueError when they cannot be joined."""
    first = layers[0]
    from localpaged.quant.joined_linear import JoinedLinear, joins_exactly
    from localpaged.quant.q8_linear import Q8Linear
    from localpaged.quant.w6_linear import W6Linear

    if not joins_exactly(layers):  # CPU layers of different forms: each keeps its own bytes
        return JoinedLinear(layers)
    if isinstance(first, (Q8Linear, W6Linear)):  # all of one form: one matrix of it
        return type(first).concat(layers)
    if any(type(layer) is not type(first) for layer in layers):
        raise ValueError("cannot join layers of different kinds")
    if any((layer.bias is None) != (first.bias is None) for layer in layers):
        raise ValueError("cannot join layers with and without bias")
    if type(first) is nn.Linear:
        fused = nn.Linear(first.in_features, sum(layer.out_features for layer in layers),
                          bias=first.bias is not None, device="meta")
        fused.weight = nn.Parameter(torch.cat([layer.weight for layer in layers]),
                                    requires_grad=False)
        if first.bias is not None:
            fused.bias = nn.Parameter(torch.cat([layer.bias for layer in layers]),
                                      requires_grad=False)
        return fused
    if not hasattr(first, "concat"):
        raise ValueError(f"cannot join {type(first).__name__} layers")
    from localpaged.quant.linear import read_in_one_order

    if not read_in_one_order(layers):
        # act-order GPTQ whose q/k/v (gate/up) were ordered apart: one matrix cannot hold
        # them, the parts side by side can (the native decode layer gathers x per part)
        return JoinedLinear(layers)
    return type(first).concat(layers)  # QuantLinear


def _fuse(module: nn.Module, fused_name: str, names: tuple[str, ...]) -> None:
    """Set `module.<fused_name>` to the layers `module.<names>` joined, and drop those. Does
    nothing when already fused; layers that cannot be joined (mixed kinds) stay apart."""
    if getattr(module, fused_name) is not None:
        return
    try:
        fused = fuse_linears([getattr(module, name) for name in names])
    except ValueError:
        return
    setattr(module, fused_name, fused)
    for name in names:
        delattr(module, name)


def _merge_rows(num_rows: int, *parts: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One (output, residual) pair of `num_rows` rows from sub-batches given as
    (their rows in the step, (output, residual))."""
    first = parts[0][1][0]
    out = first.new_empty(num_rows, first.shape[1])
    res = torch.empty_like(out)
    for rows, (o, r) in parts:
        out.index_copy_(0, rows, o.to(out.dtype))
        res.index_copy_(0, rows, r.to(res.dtype))
    return out, res


class RMSNorm(nn.Module):
    """RMSNorm whose forward fuses the residual add before it (see kernels.rms_norm)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.head_dim**-0.5
        kw = dict(dtype=dtype, device=device)
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.qkv_bias, **kw)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias, **kw)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias, **kw)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias, **kw)
        self.qkv_proj: nn.Module | None = None  # set by fuse_projections
        # Qwen3: each head of q and k RMS-normalized (weights over head_dim) before rotary
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device) if c.qk_norm else None

    def fuse_projections(self) -> None:
        """Replace q/k/v with one layer computing all three (one matmul instead of three)."""
        _fuse(self, "qkv_proj", ("q_proj", "k_proj", "v_proj"))

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv_proj is not None:
            nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split((nq, nkv, nkv), dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim))[0].view(t, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim))[0].view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, positions, cos_sin, meta.derived)
        k_cache, v_cache = kv_cache
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 intermediate_size: int | None = None):
        super().__init__()
        c, kw = config, dict(dtype=dtype, device=device)
        inter = intermediate_size or c.intermediate_size
        self.gate_proj = nn.Linear(c.hidden_size, inter, bias=c.mlp_bias, **kw)
        self.up_proj = nn.Linear(c.hidden_size, inter, bias=c.mlp_bias, **kw)
        self.down_proj = nn.Linear(inter, c.hidden_size, bias=c.mlp_bias, **kw)
        self.gate_up_proj: nn.Module | None = None  # set by fuse_projections

    def fuse_projections(self) -> None:
        """Replace gate and up with one layer computing both, side by side."""
        _fuse(self, "gate_up_proj", ("gate_proj", "up_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
        else:
            gate_up = torch.cat((self.gate_proj(x), self.up_proj(x)), -1)
        return self.down_proj(silu_and_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 index: int = 0):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.self_attn = Attention(config, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.mlp: nn.Module
        if config.is_moe_layer(index):
            from localpaged.model.moe import SparseMoE

            self.mlp = SparseMoE(config, dtype, device)
        else:
            self.mlp = MLP(config, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, cos_sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        # An explicit weight skips the random init (slow on the meta device).
        weight = torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype, device, i) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, hidden];
    compute_logits(hidden [N, hidden]) -> float32 [N, vocab]."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.model = LlamaModel(config, dtype, device)
        self.lm_head = nn.Linear(
            config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device
        )
        self.tie_weights()
        rope_device = "cpu" if torch.device(device).type == "meta" else device
        self.register_buffer("cos_sin", build_cos_sin(config, rope_device), persistent=False)
        # Decode rows through one native call per layer (CPU, 4-bit; set by
        # localpaged.model.optimize when every layer qualifies); prompt chunks beside them
        # through the layers below.
        self.cpu_decode: Any = None

    def fuse_projections(self) -> None:
        """Join q/k/v and gate/up into one matmul each, for inference. Loading by HF names
        (and quantizing) must happen before."""
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def rope_offset(self, num_prompt_tokens: int) -> int:
        """What to add to the positions of a request with this many prompt tokens to read its
        rows of `cos_sin` (LongRoPE's long set lies past the short one; see model.rope)."""
        return table_offset(self.config, num_prompt_tokens)

    def tie_weights(self) -> None:
        """Share lm_head's weight with the embedding when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def materialize(self, device: torch.device | str) -> LlamaForCausalLM:
        """Give a model built on the meta device real (uninitialized) storage on `device`.
        Each meta tensor is replaced by `torch.empty` of its shape: `Module.to_empty` takes
        torch's reference `empty_like`, whose first call imports sympy (0.4-0.6 s of a load)."""
        for module in self.modules():
            for name, p in module._parameters.items():
                if p is not None and p.is_meta:
                    module._parameters[name] = nn.Parameter(
                        torch.empty(p.shape, dtype=p.dtype, device=device),
                        requires_grad=p.requires_grad)
            for name, b in module._buffers.items():
                if b is not None and b.is_meta:
                    module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
        self.tie_weights()
        self.cos_sin = build_cos_sin(self.config, device)
        return self

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        done = None
        if self.cpu_decode is not None:
            if meta.is_decode_only:
                done = self.cpu_decode.run(h, positions, self.cos_sin, kv_caches, meta)
            else:
                done = self._run_mixed(h, positions, kv_caches, meta)
        h, residual = done if done is not None else self._run_layers(h, positions, kv_caches,
                                                                     meta)
        h, _ = self.model.norm(h, residual)
        return h

    def _run_layers(self, h: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                    meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, residual) of the last layer, through the torch layers."""
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, positions, self.cos_sin, kv_cache, meta)
        assert residual is not None
        return h, residual

    def _run_mixed(self, h: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                   meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(output, residual) of the last layer for a step with prompt chunks: decodes and
        chunks within `native_limits` (tokens, and tokens x context) through the native plan
        (each chunk token a row of its own, `token_rows`: no torch fixed cost per layer for a
        follow-up turn or a chunk beside decodes), longer chunks through the torch layers as a
        batch of their own. None when no request is short enough or the plan cannot run it."""
        starts = meta.query_start_loc.tolist()
        lens = [starts[i + 1] - starts[i] for i in range(len(starts) - 1)]
        max_query, max_attention = native_limits(h.dtype)
        native = [n <= max_query and (n == 1 or n * ctx <= max_attention)
                  for n, ctx in zip(lens, meta.seq_lens.tolist())]
        short = [i for i, yes in enumerate(native) if yes]
        if not short:
            return None
        longer = [i for i, yes in enumerate(native) if not yes]
        nat_meta, nat_rows = select_requests(meta, short)
        done = self.cpu_decode.run(h.index_select(0, nat_rows), positions.index_select(0, nat_rows),
                                   self.cos_sin, kv_caches, token_rows(nat_meta))
        if done is None:
            return None
        if not longer:
            return _merge_rows(h.shape[0], (nat_rows, done))
        pre_meta, pre_rows = select_requests(meta, longer)
        pre = self._run_layers(h.index_select(0, pre_rows), positions.index_select(0, pre_rows),
                               kv_caches, pre_meta)
        return _merge_rows(h.shape[0], (nat_rows, done), (pre_rows, pre))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of the rows the engine samples."""
        return self.lm_head(hidden).float()

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of one layer's K (or V) cache."""
        return (num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)

    def kv_cache_dtype(self, device: torch.device | str | None = None) -> torch.dtype:
        """The KV cache's element type: the model's, but float16 for a float32 model on the
        CPU (half the memory a context keeps and a decode step reads, as llama.cpp's default
        cache; attention still computes in float32 over the exactly widened values). The
        Triton kernels (GPU, or the CPU interpreter) keep the model's type."""
        dev = torch.device(device or self.cos_sin.device)
        if self.dtype == torch.float32 and dev.type == "cpu" and not use_triton_on(dev):
            return torch.float16
        return self.dtype

    def kv_cache_bytes_per_block(self, block_size: int, dtype: torch.dtype | None = None) -> int:
        """Bytes one block takes over all layers, K and V."""
        c, dt = self.config, dtype or self.kv_cache_dtype()
        per_layer = 2 * block_size * c.num_kv_heads * c.head_dim * dt.itemsize
        return per_layer * c.num_layers

    def allocate_kv_caches(
        self,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> list[KVCache]:
        """Zeroed (K, V) caches for every layer, of `kv_cache_dtype` on the model's device by
        default.

        On the CPU they lie in one anonymous memory map: the OS hands out its zeroed pages as
        they are first written, so a pool sized for many chats takes memory as it is used."""
        shape = self.kv_cache_shape(num_blocks, block_size)
        dev = torch.device(device or self.cos_sin.device)
        dt = dtype or self.kv_cache_dtype(dev)
        layers = self.config.num_layers
        if dev.type == "cpu":
            pool = zeroed_on_demand((layers, 2, *shape), dt)
            return [(pool[i, 0], pool[i, 1]) for i in range(layers)]
        return [(torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev))
                for _ in range(layers)]


def zeroed_on_demand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros whose memory pages are only taken when first written (an
    anonymous private map; the tensor keeps it alive)."""
    count = math.prod(shape)
    buffer = mmap.mmap(-1, max(1, count * dtype.itemsize))
    return torch.frombuffer(buffer, dtype=torch.uint8, count=count * dtype.itemsize
                            ).view(dtype).view(shape)
