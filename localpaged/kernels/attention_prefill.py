"""Paged prefill attention in Triton: chunks of new tokens over a cached prefix.

One launch serves a flat batch of requests with variable query lengths (`query_start_loc`)
and context lengths (`seq_lens`): grid (request, query tile, kv_head). A program's rows are
BLOCK_Q query tokens x the G_PAD query heads that share its KV head (GQA), so every K/V tile
it loads from the paged cache serves the whole group. Query row i of a request with q_len new
tokens sits at context position seq_len - q_len + i and attends causally to positions <= it:
this covers a fresh prompt, a chunk of a chunked prefill, a prompt after a prefix-cache hit,
and decode rows mixed into the same batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from localpaged.kernels._triton import interpreter_active, jit, next_pow2, tl
from localpaged.kernels.attention_decode import NO_WINDOW, kv_tile

if TYPE_CHECKING:
    from localpaged.kernels.attention import AttentionMetadata


@jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
    scale, window,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Causal online-softmax attention of BLOCK_Q query tokens x GROUP heads of one request;
    a query at position p sees keys p - window + 1 .. p (`window` huge: no window)."""
    seq = tl.program_id(0).to(tl.int64)
    q_tile = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len  # context position of the request's first query row

    r = tl.arange(0, BLOCK_Q * G_PAD)
    qi = q_tile * BLOCK_Q + r // G_PAD
    gi = r % G_PAD
    head = kvh * GROUP + gi
    row_mask = (qi < q_len) & (gi < GROUP)
    d = tl.arange(0, D_PAD)
    d_mask = d < HEAD_DIM
    tok = (q_start + qi).to(tl.int64)
    q_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=q_mask, other=0.0)
    q = q.to(k_ptr.dtype.element_ty)
    if UPCAST:  # the interpreter has no bf16 dot: round to bf16, multiply in fp32
        q = q.to(tl.float32)
    q_pos = first_pos + qi

    m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_Q * G_PAD], 0.0, tl.float32)
    acc = tl.full([BLOCK_Q * G_PAD, D_PAD], 0.0, tl.float32)
    kv_end = tl.minimum(seq_len, first_pos + (q_tile + 1) * BLOCK_Q)
    # the tile's first query row sees nothing before kv_start (aligned down to whole tiles)
    kv_start = tl.maximum(first_pos + q_tile * BLOCK_Q - window + 1, 0)
    kv_start = (kv_start // TILE_N) * TILE_N
    for t0 in range(kv_start, kv_end, TILE_N):
        pos = t0 + tl.arange(0, TILE_N)
        n_mask = pos < kv_end
        blk = tl.load(bt_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=n_mask, other=0)
        blk = blk.to(tl.int64)
        off = pos % BLOCK_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + blk[:, None] * stride_kb + off[:, None] * stride_ks
                    + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale
        causal = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        causal = causal & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row that has seen no key yet (its window starts past this tile): exp(-inf) = 0,
        # not exp(-inf - -inf)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_ref)
        p = tl.exp(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vs
                    + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        p = p.to(v_ptr.dtype.element_ty)
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PREC)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Prefill (or mixed) attention: query [T, Hq, D] flat over requests -> [T, Hq, D];
    `window`: the sliding window of `attention.paged_attention` (None: none)."""
    num_tokens, num_heads, head_dim = query.shape
    assert query.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    if num_tokens == 0 or meta.num_seqs == 0:
        return out
    g_pad = next_pow2(group)
    # Rows per program: 64 on GPUs (32 for fp32: shared memory), 32 in the interpreter.
    block_m = max(32 if interpreter_active() or k_cache.element_size() > 2 else 64, g_pad)
    block_q = block_m // g_pad
    tile_n = kv_tile(head_dim, k_cache.element_size())
    grid = (meta.num_seqs, -(-max(1, meta.max_query_len) // block_q), num_kv_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, out,
        scale, window or NO_WINDOW,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        meta.block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, G_PAD=g_pad, HEAD_DIM=head_dim, D_PAD=next_pow2(head_dim, 16),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, TILE_N=tile_n,
        DOT_PREC="ieee" if k_cache.dtype == torch.float32 else "tf32",
        UPCAST=k_cache.dtype == torch.bfloat16 and interpreter_active(),
        num_warps=4 if head_dim <= 128 else 8,
    )
    return out
