"""Paged attention over the block-table KV cache: decode and prefill-with-cached-prefix.

One call serves a flat batch of requests. Request i owns the query rows
`query_start_loc[i]:query_start_loc[i+1]` (its new tokens) and a context of `seq_lens[i]`
tokens (cached prefix + new tokens, the new ones last) stored in the blocks listed in
`block_tables[i]`. Each query token attends causally: to every context token at or before its
own position. A decode is the case of one query token per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from localpaged.kernels._triton import require_triton
from localpaged.kernels.attention_decode import paged_decode_attention
from localpaged.kernels.attention_prefill import paged_prefill_attention
from localpaged.kernels.backend import use_triton


@dataclass
class AttentionMetadata:
    """Per-step batch layout shared by every layer.

    slot_mapping: [T] int64, cache slot of each new token (block_id * block_size + offset).
    block_tables: [B, max_blocks] int32, padded with 0 past each request's blocks.
    seq_lens: [B] int32, context length of each request after this step's tokens.
    query_start_loc: [B + 1] int32, prefix sums of the per-request query lengths.
    max_query_len / max_seq_len: Python ints (avoid device syncs in kernels' launch math).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


def paged_attention_torch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Torch implementation (vectorized; no loop over requests or tokens).

    query: [T, Hq, D]; caches: [num_blocks, block_size, Hkv, D]. Returns [T, Hq, D].
    """
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    b = meta.num_seqs
    n_blocks = -(-meta.max_seq_len // block_size)
    tables = meta.block_tables[:, :n_blocks].long()
    ctx = n_blocks * block_size
    # Gather each request's context: [B, Hkv, ctx, D]
    k = k_cache[tables].view(b, ctx, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache[tables].view(b, ctx, num_kv_heads, head_dim).transpose(1, 2)
    if num_kv_heads != num_heads:
        rep = num_heads // num_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    seq_lens = meta.seq_lens.long()
    key_pos = torch.arange(ctx, device=query.device)

    if meta.is_decode_only:
        q = query.view(b, num_heads, 1, head_dim)
        mask = (key_pos[None, :] < seq_lens[:, None]).view(b, 1, 1, ctx)
        out = F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=mask, scale=scale)
        return out.view(num_tokens, num_heads, head_dim).to(query.dtype)

    qsl = meta.query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]
    lq = meta.max_query_len
    # Scatter the flat queries into a padded [B, Lq, Hq, D] batch.
    seq_idx = torch.repeat_interleave(torch.arange(b, device=query.device), q_lens)
    row_in_seq = torch.arange(num_tokens, device=query.device) - qsl[seq_idx]
    q = query.new_zeros(b, lq, num_heads, head_dim)
    q[seq_idx, row_in_seq] = query
    # Absolute position of each padded query row; padded rows see key 0 only (no NaNs).
    q_pos = (seq_lens - q_lens)[:, None] + torch.arange(lq, device=query.device)[None, :]
    valid_row = torch.arange(lq, device=query.device)[None, :] < q_lens[:, None]
    mask = key_pos[None, None, :] <= q_pos[:, :, None]
    mask = mask & (key_pos[None, None, :] < seq_lens[:, None, None])
    mask = mask | (~valid_row[:, :, None] & (key_pos[None, None, :] == 0))
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2).to(k.dtype), k, v, attn_mask=mask.unsqueeze(1), scale=scale
    )
    out = out.transpose(1, 2)[seq_idx, row_in_seq]
    return out.to(query.dtype)


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Triton implementation of `paged_attention_torch`: the split-K decode kernel when every
    request has one query token, else the prefill kernel (which also serves mixed batches)."""
    require_triton()
    if meta.is_decode_only:
        return paged_decode_attention(query, k_cache, v_cache, meta, scale)
    return paged_prefill_attention(query, k_cache, v_cache, meta, scale)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each request's new query tokens over its paged context."""
    if use_triton(query):
        return paged_attention_triton(query, k_cache, v_cache, meta, scale)
    return paged_attention_torch(query, k_cache, v_cache, meta, scale)
