"""KV write: scatter the step's new keys and values into the paged cache."""

from __future__ import annotations

import torch

from localpaged.kernels._triton import jit, next_pow2, require_triton, tl
from localpaged.kernels.backend import use_triton


def write_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Torch implementation. key/value: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D];
    slot_mapping: [T] int64, slot = block_id * block_size + offset_in_block."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


@jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """One program per token: copy its [Hkv, D] key and value rows to their cache slot."""
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:  # a negative slot is padding (CUDA-graph batches): nothing to write
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, H_PAD)[:, None]
        d = tl.arange(0, D_PAD)[None, :]
        mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
        k = tl.load(key_ptr + tok * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(value_ptr + tok * stride_vt + h * stride_vh + d, mask=mask)
        k_dst = k_cache_ptr + blk * stride_cb + off * stride_cs + h * stride_ch + d
        v_dst = v_cache_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton implementation of `write_kv_torch`; slots < 0 are skipped (padding)."""
    require_triton()
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "last dim must be contiguous"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache last dim must be contiguous"
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        H_PAD=next_pow2(num_kv_heads), D_PAD=next_pow2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
    )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value rows into the caches at their slots, in place."""
    if use_triton(key):
        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
        return
    write_kv_torch(key, value, k_cache, v_cache, slot_mapping)
