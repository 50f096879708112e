"""KV write: scatter the step's new keys and values into the paged cache."""

from __future__ import annotations

import torch

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


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value rows into the caches at their slots, in place."""
    if use_triton(key):
        from localpaged.kernels.triton_ops import write_kv_triton

        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
        return
    write_kv_torch(key, value, k_cache, v_cache, slot_mapping)
