"""Random paged-attention batches for the kernel tests and benchmarks (no engine needed)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from localpaged.kernels.attention import AttentionMetadata


def make_paged_batch(
    q_lens: Sequence[int],
    seq_lens: Sequence[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Build (query [T, Hq, D], k_cache, v_cache, meta) for requests with the given new-token
    counts and context lengths. Blocks are handed out in a random order (non-contiguous,
    interleaved block tables), unused cache blocks hold noise, and the tables are padded with
    block 0 as the engine does. slot_mapping points at the new tokens' slots."""
    assert len(q_lens) == len(seq_lens) and all(0 < q <= s for q, s in zip(q_lens, seq_lens))
    gen = torch.Generator().manual_seed(seed)
    blocks_per = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slots: list[torch.Tensor] = []
    used = 0
    for i, (q_len, s) in enumerate(zip(q_lens, seq_lens)):
        ids = perm[used : used + blocks_per[i]]
        used += blocks_per[i]
        tables[i, : blocks_per[i]] = ids.to(torch.int32)
        pos = torch.arange(s - q_len, s)
        slots.append(ids[pos // block_size] * block_size + pos % block_size)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=qsl.to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    return query.to(device), k_cache.to(device), v_cache.to(device), meta


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """assert_close tolerances for a kernel-vs-torch comparison at `dtype`. The interpreter
    rounds fp32 -> bf16 toward zero (the GPU rounds to nearest), hence bf16's extra slack."""
    return {
        torch.float32: dict(atol=2e-5, rtol=2e-5),
        torch.float16: dict(atol=2e-3, rtol=2e-3),
        torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    }[dtype]
