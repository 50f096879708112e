"""Paged decode attention in Triton: one query token per request (flash-decoding).

Grid (request, kv_head, split): a program holds all the query heads that share its KV head
(GQA: each K/V tile is loaded once for the whole group) and walks its split of the context
in tiles of TILE_N tokens, gathering each token's slot through the block table (so any block
size works and a tile may span blocks). With one split the program writes the output; with
several it writes a normalized partial output and its log-sum-exp, and `_reduce_kernel`
merges the splits. The number of splits depends on `max_seq_len` and the batch shape only,
never on tensor values, so a launch is CUDA-graph safe for a fixed `max_seq_len`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from localpaged.kernels._triton import interpreter_active, jit, next_pow2, tl

if TYPE_CHECKING:
    from localpaged.kernels.attention import AttentionMetadata

MIN_SPLIT_LEN = 256  # tokens: below this a split is not worth its reduction
NO_WINDOW = 1 << 30  # the kernels' window argument when attention has no sliding window


@jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    scale, split_len, window,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Online-softmax attention of one request's GROUP query heads over one context split,
    of which only the last `window` positions of the context are seen."""
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = tl.maximum(split * split_len, seq_len - window)
    end = tl.minimum(split * split_len + split_len, seq_len)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    heads = kvh * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=q_mask, other=0.0)
    q = q.to(k_ptr.dtype.element_ty)
    if UPCAST:  # the interpreter has no bf16 dot: round to bf16, multiply in fp32
        q = q.to(tl.float32)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.full([G_PAD], 0.0, tl.float32)
    acc = tl.full([G_PAD, D_PAD], 0.0, tl.float32)
    for t0 in range(start, end, TILE_N):
        pos = t0 + tl.arange(0, TILE_N)
        n_mask = pos < end
        blk = tl.load(bt_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=n_mask, other=0)
        blk = blk.to(tl.int64)
        off = pos % BLOCK_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + blk[:, None] * stride_kb + off[:, None] * stride_ks
                    + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vs
                    + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        p = p.to(v_ptr.dtype.element_ty)
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PREC)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # an empty split / seq_len 0 gives zeros
    out = acc / l_safe[:, None]
    o_ptrs = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :]
    if SPLIT:
        tl.store(o_ptrs + split * stride_os, out, mask=q_mask)
        lse = m_i + tl.log(tl.maximum(l_i, 1e-30))
        tl.store(lse_ptr + seq * stride_lt + heads * stride_lh + split, lse, mask=g_mask)
    else:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@jit
def _reduce_kernel(
    part_ptr, lse_ptr, out_ptr, num_splits,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh,
    S_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    """Program (request, head): merge the splits' partial outputs weighted by exp(lse)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_mask = s < num_splits
    lse = tl.load(lse_ptr + seq * stride_lt + head * stride_lh + s, mask=s_mask,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)
    part = tl.load(part_ptr + seq * stride_pt + head * stride_ph + s[:, None] * stride_ps
                   + d[None, :], mask=s_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def kv_tile(head_dim: int, elem_size: int) -> int:
    """Tokens per K/V tile: 16 KiB tiles on GPUs (fits the 99 KiB of shared memory of sm_86/89
    too, see aot_check), 16 tokens in the interpreter."""
    if interpreter_active():
        return 16
    return max(16, min(64, 16384 // (next_pow2(head_dim, 16) * elem_size)))


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device
) -> int:
    """Splits per request: enough programs to fill the GPU, each split >= MIN_SPLIT_LEN."""
    if device.type != "cuda":
        return 1
    sms = _num_sms(device)
    want = -(-2 * sms // max(1, num_seqs * num_kv_heads))
    most = max(1, max_seq_len // MIN_SPLIT_LEN)
    return max(1, min(want, most, 64))


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Decode attention: query [B, Hq, D] (one token per request) -> [B, Hq, D].

    `num_splits` overrides the split-K heuristic (tests use it to exercise the reduction);
    `window`: each query sees only the last `window` positions of its context (None: all).
    """
    num_seqs, num_heads, head_dim = query.shape
    assert query.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    tile_n = kv_tile(head_dim, k_cache.element_size())
    max_seq_len = max(1, meta.max_seq_len)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, query.device)
    split_len = -(-max_seq_len // num_splits)
    split_len = -(-split_len // tile_n) * tile_n
    num_splits = -(-max_seq_len // split_len)
    split = num_splits > 1
    if split:
        part = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32,
                           device=query.device)
        lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32,
                          device=query.device)
        dst, lse_arg = part, lse
        s_os, s_lt, s_lh = part.stride(2), lse.stride(0), lse.stride(1)
    else:
        dst, lse_arg, s_os, s_lt, s_lh = out, out, 0, 0, 0
    d_pad = next_pow2(head_dim, 16)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, meta.block_tables, meta.seq_lens, dst, lse_arg,
        scale, split_len, window or NO_WINDOW,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        meta.block_tables.stride(0),
        dst.stride(0), dst.stride(1), s_os, s_lt, s_lh,
        GROUP=group, G_PAD=next_pow2(group, 16), HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=block_size, TILE_N=tile_n, SPLIT=split,
        DOT_PREC="ieee" if k_cache.dtype == torch.float32 else "tf32",
        UPCAST=k_cache.dtype == torch.bfloat16 and interpreter_active(),
        num_warps=4 if head_dim <= 128 else 8,
    )
    if split:
        _reduce_kernel[(num_seqs, num_heads)](
            part, lse, out, num_splits,
            part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            S_PAD=next_pow2(num_splits), HEAD_DIM=head_dim, D_PAD=d_pad,
        )
    return out
