"""Paged attention over the block-table KV cache: decode and prefill-with-cached-prefix.

One call serves a flat batch of requests. Request i owns the query rows
`query_start_loc[i]:query_start_loc[i+1]` (its new tokens) and a context of `seq_lens[i]`
tokens (cached prefix + new tokens, the new ones last) stored in the blocks listed in
`block_tables[i]`. Each query token attends causally: to every context token at or before its
own position. A decode is the case of one query token per request.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from localpaged.kernels._triton import require_triton
from localpaged.kernels.attention_cpu import paged_decode_attention_cpu, supports
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
    # Tensors derived from the fields above, built by the first layer that needs them and
    # reused by the others (one step = one metadata object).
    derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def memo(self, key: str, build: Callable[[], Any]) -> Any:
        """`build()` on first use for this step, the same value after."""
        if key not in self.derived:
            self.derived[key] = build()
        return self.derived[key]

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


def select_requests(meta: AttentionMetadata, requests: list[int]
                    ) -> tuple[AttentionMetadata, torch.Tensor]:
    """The requests `requests` (indices into `meta`'s batch, in that order) as a batch of
    their own: its metadata, and the flat rows of their query tokens in `meta`'s batch (to
    take their inputs with and put their outputs back). Their slots, block tables and
    context lengths are theirs unchanged, so their KV goes where it would have gone."""
    starts = meta.query_start_loc.tolist()
    rows = [t for i in requests for t in range(starts[i], starts[i + 1])]
    lens = [starts[i + 1] - starts[i] for i in requests]
    dev = meta.query_start_loc.device
    index = torch.tensor(requests, dtype=torch.long, device=dev)
    rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
    seq_lens = meta.seq_lens.index_select(0, index)
    sub = AttentionMetadata(
        slot_mapping=meta.slot_mapping.index_select(0, rows_t),
        block_tables=meta.block_tables.index_select(0, index),
        seq_lens=seq_lens,
        query_start_loc=torch.tensor([0, *itertools.accumulate(lens)],
                                     dtype=meta.query_start_loc.dtype, device=dev),
        max_query_len=max(lens, default=0),
        max_seq_len=int(seq_lens.max()) if requests else 0,
    )
    return sub, rows_t


def token_rows(meta: AttentionMetadata) -> AttentionMetadata:
    """`meta` with each query token a request of its own (one query row each): the same
    table, and a context ending at the token's own position. Attention over it equals
    `meta`'s causal attention, provided every new token's K/V is in the cache before any
    row attends (as the native decode layer does: all rows' K/V first, then attention)."""
    starts = meta.query_start_loc
    lens = (starts[1:] - starts[:-1]).long()
    owner = torch.repeat_interleave(torch.arange(lens.numel(), device=starts.device), lens)
    # token j of a request of q tokens sees its context up to seq_len - (q - 1 - j)
    offset_from_end = torch.arange(owner.numel(), device=starts.device) - starts[:-1].long()[owner]
    seq_lens = meta.seq_lens[owner] - (lens[owner] - 1 - offset_from_end).to(meta.seq_lens.dtype)
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        block_tables=meta.block_tables.index_select(0, owner),
        seq_lens=seq_lens,
        query_start_loc=torch.arange(owner.numel() + 1, dtype=starts.dtype, device=starts.device),
        max_query_len=1 if owner.numel() else 0,
        max_seq_len=meta.max_seq_len,
    )


def _additive_mask(hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where a key is seen, -inf where `hidden` (SDPA reads this faster than a bool mask)."""
    return torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill(
        hidden, float("-inf"))


def _widened(k: torch.Tensor, v: torch.Tensor, query: torch.Tensor,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gathered keys and values in the query's type where the cache is narrower (a float32
    model's float16 cache: attention computed in float32, as the C kernel does)."""
    work = torch.promote_types(query.dtype, k.dtype)
    return (k, v) if k.dtype == work else (k.to(work), v.to(work))


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
    ctx = n_blocks * block_size

    def gather_blocks() -> torch.Tensor:
        return meta.block_tables[:, :n_blocks].long().flatten()

    def first_of_consecutive_blocks() -> int | None:
        if b != 1:
            return None
        ids = meta.block_tables[0, :n_blocks].tolist()
        return ids[0] if ids == list(range(ids[0], ids[0] + n_blocks)) else None

    # Each request's context: [B, Hkv, ctx, D] (a strided view). One request whose blocks
    # are consecutive (common: the pool hands out never-used blocks in order) is a plain
    # slice of the cache; otherwise gather block by block (index_select copies whole blocks,
    # several times faster than advanced indexing).
    first = meta.memo("attn.first_block", first_of_consecutive_blocks)
    if first is not None:
        k = k_cache[first:first + n_blocks].view(b, ctx, num_kv_heads, head_dim).transpose(1, 2)
        v = v_cache[first:first + n_blocks].view(b, ctx, num_kv_heads, head_dim).transpose(1, 2)
    else:
        blocks = meta.memo("attn.blocks", gather_blocks)
        k = k_cache.index_select(0, blocks).view(b, ctx, num_kv_heads, head_dim).transpose(1, 2)
        v = v_cache.index_select(0, blocks).view(b, ctx, num_kv_heads, head_dim).transpose(1, 2)
    k, v = _widened(k, v, query)
    dev = query.device

    if meta.is_decode_only:
        # The query heads that share a KV head are rows of one attention problem (GQA).
        rep = num_heads // num_kv_heads
        q = query.view(b, num_kv_heads, rep, head_dim).to(k.dtype)

        def decode_mask() -> torch.Tensor:
            key_pos = torch.arange(ctx, device=dev)
            hidden = (key_pos[None, :] >= meta.seq_lens.long()[:, None]).view(b, 1, 1, ctx)
            return _additive_mask(hidden, k.dtype)

        if b == 1:  # one request: cut its context to length instead of masking the rest
            k, v, mask = k[:, :, :meta.max_seq_len], v[:, :, :meta.max_seq_len], None
        else:
            mask = meta.memo("attn.decode_mask", decode_mask)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return out.reshape(num_tokens, num_heads, head_dim).to(query.dtype)

    if b == 1:
        # One request (a chat turn): its queries are the last rows of its context, so no
        # padding; the mask is the lower-right causal triangle, plain causal with no prefix.
        seq_len = meta.max_seq_len
        k, v = k[:, :, :seq_len], v[:, :, :seq_len]
        q = query.view(1, num_tokens, num_heads, head_dim).transpose(1, 2).to(k.dtype)
        gqa = num_kv_heads != num_heads
        if num_tokens == seq_len:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                 enable_gqa=gqa)
        else:
            def lower_right_mask() -> torch.Tensor:
                rows = torch.arange(num_tokens, device=dev)[:, None] + (seq_len - num_tokens)
                hidden = torch.arange(seq_len, device=dev)[None, :] > rows
                return _additive_mask(hidden, k.dtype)[None, None]

            mask = meta.memo("attn.lower_right_mask", lower_right_mask)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                 enable_gqa=gqa)
        return out.transpose(1, 2).reshape(num_tokens, num_heads, head_dim).to(query.dtype)

    def prefill_layout() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        seq_lens = meta.seq_lens.long()
        key_pos = torch.arange(ctx, device=dev)
        qsl = meta.query_start_loc.long()
        q_lens = qsl[1:] - qsl[:-1]
        lq = meta.max_query_len
        # Where each flat query row goes in a padded [B, Lq] batch.
        seq_idx = torch.repeat_interleave(torch.arange(b, device=dev), q_lens)
        row_in_seq = torch.arange(num_tokens, device=dev) - qsl[seq_idx]
        # Absolute position of each padded query row; padded rows see key 0 only (no NaNs).
        q_pos = (seq_lens - q_lens)[:, None] + torch.arange(lq, device=dev)[None, :]
        valid_row = torch.arange(lq, device=dev)[None, :] < q_lens[:, None]
        mask = key_pos[None, None, :] <= q_pos[:, :, None]
        mask = mask & (key_pos[None, None, :] < seq_lens[:, None, None])
        mask = mask | (~valid_row[:, :, None] & (key_pos[None, None, :] == 0))
        return seq_idx, row_in_seq, mask.unsqueeze(1)

    seq_idx, row_in_seq, mask = meta.memo("attn.prefill_layout", prefill_layout)
    q = query.new_zeros(b, meta.max_query_len, num_heads, head_dim)
    q[seq_idx, row_in_seq] = query
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2).to(k.dtype), k, v, attn_mask=mask, scale=scale,
        enable_gqa=num_kv_heads != num_heads,
    )
    out = out.transpose(1, 2)[seq_idx, row_in_seq]
    return out.to(query.dtype)


def paged_attention_windowed_torch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int,
) -> torch.Tensor:
    """`paged_attention_torch` with a sliding window: a query at position p sees the keys at
    positions p - window + 1 .. p (HF's `kv_idx > q_idx - sliding_window`). Each request's
    context is gathered from the first block its window reaches, so the work follows the
    window, not the whole context."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    b, lq, dev = meta.num_seqs, meta.max_query_len, query.device
    if num_tokens == 0:
        return torch.empty_like(query)

    def layout() -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor, torch.Tensor]:
        seq_lens = meta.seq_lens.long()
        qsl = meta.query_start_loc.long()
        q_lens = qsl[1:] - qsl[:-1]
        first_blk = (seq_lens - q_lens - window + 1).clamp(min=0) // block_size
        last_blk = (seq_lens - 1).clamp(min=0) // block_size
        n_blocks = int((last_blk - first_blk).max()) + 1
        idx = (first_blk[:, None] + torch.arange(n_blocks, device=dev)[None, :]).clamp(
            max=meta.block_tables.shape[1] - 1)
        blocks = meta.block_tables.long().gather(1, idx).flatten()
        ctx = n_blocks * block_size
        key_pos = (first_blk * block_size)[:, None, None] + torch.arange(ctx, device=dev)
        seq_idx = torch.repeat_interleave(torch.arange(b, device=dev), q_lens)
        row_in_seq = torch.arange(num_tokens, device=dev) - qsl[seq_idx]
        q_pos = ((seq_lens - q_lens)[:, None] + torch.arange(lq, device=dev)[None, :])[:, :, None]
        mask = (key_pos <= q_pos) & (key_pos > q_pos - window)
        mask = mask & (key_pos < seq_lens[:, None, None])
        valid_row = torch.arange(lq, device=dev)[None, :] < q_lens[:, None]
        # padded query rows see their context's first key only (no NaNs)
        mask = mask | (~valid_row[:, :, None] & (torch.arange(ctx, device=dev) == 0))
        return blocks, ctx, seq_idx, row_in_seq, mask.unsqueeze(1)

    blocks, ctx, seq_idx, row_in_seq, mask = meta.memo(f"attn.window.{window}", layout)
    k = k_cache.index_select(0, blocks).view(b, ctx, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, blocks).view(b, ctx, num_kv_heads, head_dim).transpose(1, 2)
    k, v = _widened(k, v, query)
    q = query.new_zeros(b, lq, num_heads, head_dim)
    q[seq_idx, row_in_seq] = query
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2).to(k.dtype), k, v, attn_mask=mask, scale=scale,
        enable_gqa=num_kv_heads != num_heads,
    )
    return out.transpose(1, 2)[seq_idx, row_in_seq].to(query.dtype)


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Triton implementation of `paged_attention_torch`: the split-K decode kernel when every
    request has one query token, else the prefill kernel (which also serves mixed batches).
    `window`: see `paged_attention`."""
    require_triton()
    if meta.is_decode_only:
        return paged_decode_attention(query, k_cache, v_cache, meta, scale, window=window)
    return paged_prefill_attention(query, k_cache, v_cache, meta, scale, window=window)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new query tokens over its paged context; with a
    `window` (sliding-window layers) a query sees only the `window` latest positions up to
    its own, masked exactly: the cache still holds the whole context."""
    if window is not None and meta.max_seq_len <= window:
        window = None  # every context fits its window: plain causal attention is the same
    if use_triton(query):
        return paged_attention_triton(query, k_cache, v_cache, meta, scale, window)
    if window is not None:
        return paged_attention_windowed_torch(query, k_cache, v_cache, meta, scale, window)
    if meta.is_decode_only and meta.memo("attn.cpu_kernel", lambda: supports(query, k_cache)):
        return paged_decode_attention_cpu(query, k_cache, v_cache, meta.block_tables,
                                          meta.seq_lens, scale)
    return paged_attention_torch(query, k_cache, v_cache, meta, scale)
