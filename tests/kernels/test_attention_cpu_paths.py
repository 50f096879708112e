"""The torch attention's shortcuts give what plain attention gives: one request's context
read as a slice when its blocks are consecutive, cut to length instead of masked."""

from __future__ import annotations

import pytest
import torch

from localpaged.kernels.attention import AttentionMetadata, paged_attention_torch


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Hq, D] attends to all of k, v [L, Hkv, D] (GQA by head groups)."""
    rep = q.shape[0] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1).float(), v.repeat_interleave(rep, 1).float()
    w = torch.einsum("hd,lhd->hl", q.float(), kk) * scale
    return torch.einsum("hl,lhd->hd", w.softmax(-1), vv)


BS, HQ, HKV, D = 16, 6, 2, 32


def _one_request(g: torch.Generator, length: int, blocks: list[int]):
    """Random K/V caches and one request's context of `length` tokens in `blocks`: the caches
    and that context read out plainly, [length, Hkv, D] each."""
    k_cache = torch.randn(12, BS, HKV, D, generator=g)
    v_cache = torch.randn(12, BS, HKV, D, generator=g)
    k = torch.cat([k_cache[b] for b in blocks])[:length]
    v = torch.cat([v_cache[b] for b in blocks])[:length]
    return k_cache, v_cache, k, v


@pytest.mark.parametrize("consecutive", [True, False])
@pytest.mark.parametrize("length", [1, 16, 37])
def test_one_request_decode_equals_plain_attention(consecutive: bool, length: int) -> None:
    g = torch.Generator().manual_seed(length)
    bs, hq, d = BS, HQ, D
    n = -(-length // bs)
    blocks = list(range(4, 4 + n)) if consecutive else [9, 2, 7][:n]
    k_cache, v_cache, k, v = _one_request(g, length, blocks)
    q = torch.randn(1, hq, d, generator=g)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([blocks[-1] * bs + (length - 1) % bs]),
        block_tables=torch.tensor([[*blocks, 0]], dtype=torch.int32),
        seq_lens=torch.tensor([length], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32), max_query_len=1,
        max_seq_len=length)
    out = paged_attention_torch(q, k_cache, v_cache, meta, d**-0.5)
    assert (meta.derived["attn.first_block"] is not None) == (consecutive or n == 1)
    torch.testing.assert_close(out[0], _reference(q[0], k, v, d**-0.5), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("consecutive", [True, False])
@pytest.mark.parametrize(("cached", "new"), [(0, 1), (0, 21), (16, 9), (20, 17)])
def test_one_request_prefill_equals_plain_causal_attention(
    consecutive: bool, cached: int, new: int
) -> None:
    """A chat turn: `new` query tokens after `cached` context tokens, each query seeing the
    context and the new tokens up to itself."""
    g = torch.Generator().manual_seed(cached * 100 + new)
    bs, hq, d = BS, HQ, D
    length = cached + new
    n = -(-length // bs)
    blocks = list(range(5, 5 + n)) if consecutive else [10, 3, 8][:n]
    k_cache, v_cache, k, v = _one_request(g, length, blocks)
    q = torch.randn(new, hq, d, generator=g)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([blocks[p // bs] * bs + p % bs for p in range(cached, length)]),
        block_tables=torch.tensor([[*blocks, 0]], dtype=torch.int32),
        seq_lens=torch.tensor([length], dtype=torch.int32),
        query_start_loc=torch.tensor([0, new], dtype=torch.int32), max_query_len=new,
        max_seq_len=length)
    out = paged_attention_torch(q, k_cache, v_cache, meta, d**-0.5)
    for i in range(new):
        visible = cached + i + 1
        torch.testing.assert_close(out[i], _reference(q[i], k[:visible], v[:visible], d**-0.5),
                                   rtol=1e-4, atol=1e-5)
