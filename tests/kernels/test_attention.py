"""Paged attention: the Triton decode (split-K) and prefill kernels vs paged_attention_torch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localpaged.kernels.attention import paged_attention_torch, paged_attention_triton
from localpaged.kernels.attention_decode import paged_decode_attention
from localpaged.kernels.attention_prefill import paged_prefill_attention
from localpaged.kernels.testing import make_paged_batch, tolerance

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (num_heads, num_kv_heads, head_dim, block_size, dtype): GQA ratios 1/3/8, head dims 64/128
# (and the padded 80/96), block sizes 8/16/32, every dtype at least twice.
DECODE_CASES = [
    (2, 2, 64, 16, F32),
    (3, 1, 64, 8, F16),
    (8, 1, 128, 16, BF16),
    (6, 2, 128, 8, F32),
    (4, 4, 128, 32, F16),
    (8, 1, 64, 32, F32),
    (3, 1, 80, 16, BF16),
    (6, 2, 96, 16, F16),
]


def _decode_lens(block_size: int) -> list[int]:
    """Context lengths 1, block_size - 1, block_size, block_size + 1 and a few blocks."""
    return [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("hq", "hkv", "d", "bs", "dtype"), DECODE_CASES)
def test_decode(device: str, hq: int, hkv: int, d: int, bs: int, dtype: torch.dtype,
                num_splits: int) -> None:
    seq_lens = _decode_lens(bs)
    q, kc, vc, meta = make_paged_batch([1] * len(seq_lens), seq_lens, hq, hkv, d, bs, dtype,
                                       device, seed=hq + d + bs)
    out = paged_decode_attention(q, kc, vc, meta, d**-0.5, num_splits=num_splits)
    ref = paged_attention_torch(q, kc, vc, meta, d**-0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **tolerance(dtype))


def test_decode_many_splits_and_default_dispatch(device: str) -> None:
    """More splits than some requests have tokens (empty splits), and the dispatcher's choice."""
    seq_lens = [70, 3, 33]
    q, kc, vc, meta = make_paged_batch([1, 1, 1], seq_lens, 4, 2, 64, 8, F32, device, seed=7)
    ref = paged_attention_torch(q, kc, vc, meta, 0.1)
    for splits in (2, 5, 70):
        out = paged_decode_attention(q, kc, vc, meta, 0.1, num_splits=splits)
        torch.testing.assert_close(out, ref, **tolerance(F32))
    torch.testing.assert_close(paged_attention_triton(q, kc, vc, meta, 0.1), ref,
                               **tolerance(F32))


def test_decode_zero_length_padding_rows_give_zeros(device: str) -> None:
    """CUDA-graph padding rows (seq_len 0) must not produce NaNs or touch real rows."""
    q, kc, vc, meta = make_paged_batch([1, 1], [9, 1], 2, 1, 64, 8, F32, device)
    ref = paged_attention_torch(q, kc, vc, meta, 0.125)
    meta.seq_lens[1] = 0
    for splits in (1, 2):
        out = paged_decode_attention(q, kc, vc, meta, 0.125, num_splits=splits)
        torch.testing.assert_close(out[0], ref[0], **tolerance(F32))
        assert torch.count_nonzero(out[1]) == 0


# (q_lens, seq_lens): no prefix, with a cached prefix (prefix-cache hit / chunked prefill),
# decode rows mixed in, chunks starting exactly on and just off block boundaries.
PREFILL_BATCHES = {
    "fresh_prompts": ([5, 17, 1], [5, 17, 1]),
    "cached_prefix": ([3, 8, 16], [20, 24, 32]),
    "mixed_decode_and_chunks": ([1, 7, 1, 12], [17, 30, 1, 12]),
    "boundary_chunks": ([16, 15, 17], [32, 31, 33]),
}
PREFILL_CASES = [
    (2, 2, 64, 16, F32),
    (3, 1, 64, 8, F16),
    (8, 1, 128, 16, BF16),
    (6, 2, 128, 8, F32),
    (8, 1, 64, 32, F16),
]


@pytest.mark.parametrize("batch", list(PREFILL_BATCHES))
@pytest.mark.parametrize(("hq", "hkv", "d", "bs", "dtype"), PREFILL_CASES)
def test_prefill(device: str, batch: str, hq: int, hkv: int, d: int, bs: int,
                 dtype: torch.dtype) -> None:
    q_lens, seq_lens = PREFILL_BATCHES[batch]
    q, kc, vc, meta = make_paged_batch(q_lens, seq_lens, hq, hkv, d, bs, dtype, device,
                                       seed=len(batch) + hq)
    out = paged_prefill_attention(q, kc, vc, meta, d**-0.5)
    ref = paged_attention_torch(q, kc, vc, meta, d**-0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **tolerance(dtype))


def test_prefill_long_chunk_spans_query_tiles(device: str) -> None:
    """Queries longer than one program's query tile (several q tiles per request)."""
    q, kc, vc, meta = make_paged_batch([40, 2, 23], [45, 2, 60], 1, 1, 64, 8, F32, device)
    ref = paged_attention_torch(q, kc, vc, meta, 0.125)
    torch.testing.assert_close(paged_attention_triton(q, kc, vc, meta, 0.125), ref,
                               **tolerance(F32))


def test_prefill_kernel_serves_decode_batches(device: str) -> None:
    q, kc, vc, meta = make_paged_batch([1, 1, 1], [1, 16, 40], 4, 1, 64, 16, F16, device)
    ref = paged_attention_torch(q, kc, vc, meta, 0.125)
    torch.testing.assert_close(paged_prefill_attention(q, kc, vc, meta, 0.125), ref,
                               **tolerance(F16))


@st.composite
def _batches(draw: st.DrawFn) -> tuple[list[int], list[int], int, int, int]:
    n = draw(st.integers(1, 4))
    seq_lens = draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    q_lens = [draw(st.integers(1, s)) for s in seq_lens]
    hkv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 3, 8]))
    bs = draw(st.sampled_from([8, 16, 32]))
    return q_lens, seq_lens, hkv * group, hkv, bs


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=_batches())
def test_random_mixed_batches(device: str, batch: tuple[list[int], list[int], int, int, int]
                              ) -> None:
    q_lens, seq_lens, hq, hkv, bs = batch
    q, kc, vc, meta = make_paged_batch(q_lens, seq_lens, hq, hkv, 64, bs, F32, device)
    ref = paged_attention_torch(q, kc, vc, meta, 0.125)
    out = paged_attention_triton(q, kc, vc, meta, 0.125)
    torch.testing.assert_close(out, ref, **tolerance(F32))
