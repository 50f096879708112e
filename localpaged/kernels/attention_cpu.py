"""Decode attention on the CPU with the package's C kernel (`cpu/paged_decode.c`), which reads
each request's KV blocks in place: no gathered copy of the contexts, no padding mask. Used for
decode steps of a bf16 query over a bf16 cache, or a float32 query over a float16 cache (a
float32 model's, see `LlamaForCausalLM.kv_cache_dtype`), when the kernel builds here;
everything else takes the torch path."""

from __future__ import annotations

import torch

from localpaged.kernels import native

MAX_QUERY_HEADS_PER_KV_HEAD, MAX_HEAD_DIM = 16, 256  # the kernel's scratch sizes
# (query and output, cache) types -> the kernel's build for them
_BUILDS = {(torch.bfloat16, torch.bfloat16): "paged_decode_bf16",
           (torch.float32, torch.float16): "paged_decode_f32h"}


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether this decode step can run on the kernel (CPU tensors of one of its builds' types,
    shapes in bounds)."""
    heads, dim = query.shape[1], query.shape[2]
    kv_heads = k_cache.shape[2]
    return (query.device.type == "cpu" and (query.dtype, k_cache.dtype) in _BUILDS
            and heads % kv_heads == 0 and heads // kv_heads <= MAX_QUERY_HEADS_PER_KV_HEAD
            and dim <= MAX_HEAD_DIM and k_cache.is_contiguous() and native.available())


def paged_decode_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """query `[B, Hq, D]` (one token per request); caches `[blocks, block_size, Hkv, D]`;
    block_tables `[B, max_blocks]` int32; seq_lens `[B]` int32. Returns `[B, Hq, D]`."""
    lib = native.library()
    if lib is None:
        raise RuntimeError("the CPU decode-attention kernel is not available on this machine")
    q = query.contiguous()
    tables, lens = block_tables, seq_lens
    if tables.dtype != torch.int32 or not tables.is_contiguous():
        tables = tables.to(torch.int32).contiguous()
    if lens.dtype != torch.int32 or not lens.is_contiguous():
        lens = lens.to(torch.int32).contiguous()
    batch, heads, dim = q.shape
    out = torch.empty_like(q)
    rc = getattr(lib, _BUILDS[q.dtype, k_cache.dtype])(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
        lens.data_ptr(), out.data_ptr(), batch, heads, k_cache.shape[2], dim, k_cache.shape[1],
        scale, torch.get_num_threads())
    if rc:
        raise MemoryError("the CPU decode-attention kernel could not allocate its scratch memory")
    return out
