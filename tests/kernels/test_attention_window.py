"""Sliding-window paged attention (Gemma 3's local layers): the torch path, the Triton decode
and prefill kernels and the dispatcher's CPU choice against a plain per-request reference that
masks each query to the keys p - window + 1 .. p."""

from __future__ import annotations

import pytest
import torch

from localpaged.kernels.attention import (
    AttentionMetadata,
    paged_attention,
    paged_attention_windowed_torch,
)
from localpaged.kernels.attention_decode import paged_decode_attention
from localpaged.kernels.attention_prefill import paged_prefill_attention
from localpaged.kernels.testing import make_paged_batch, tolerance

F32, BF16 = torch.float32, torch.bfloat16


def reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: AttentionMetadata,
              scale: float, window: int) -> torch.Tensor:
    """Each request's keys gathered one by one, softmax over the window, in float32."""
    bs, hkv = kc.shape[1], kc.shape[2]
    rep = q.shape[1] // hkv
    out = torch.empty(q.shape, dtype=torch.float32)
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        table = meta.block_tables[i].tolist()
        slots = [table[p // bs] * bs + p % bs for p in range(seq_len)]
        k = kc.flatten(0, 1)[slots].float().repeat_interleave(rep, 1)  # [S, Hq, D]
        v = vc.flatten(0, 1)[slots].float().repeat_interleave(rep, 1)
        n = starts[i + 1] - starts[i]
        for j in range(n):
            p = seq_len - n + j
            lo = max(0, p - window + 1)
            s = torch.einsum("hd,shd->hs", q[starts[i] + j].float(), k[lo:p + 1]) * scale
            out[starts[i] + j] = torch.einsum("hs,shd->hd", s.softmax(-1), v[lo:p + 1])
    return out.to(q.dtype)


# (q_lens, seq_lens): a fresh prompt longer than the window, a chunk after a cached prefix, a
# decode row past the window, a short request inside it, all in one batch
MIXED = ([20, 7, 1, 3], [20, 41, 50, 3])


@pytest.mark.parametrize("window", [1, 5, 16, 21])
def test_torch_windowed_equals_reference(window: int) -> None:
    q, kc, vc, meta = make_paged_batch(*MIXED, 4, 2, 32, 8, F32, seed=window)
    out = paged_attention_windowed_torch(q, kc, vc, meta, 0.2, window)
    torch.testing.assert_close(out, reference(q, kc, vc, meta, 0.2, window), **tolerance(F32))
    # the dispatcher takes the same path; a window past every context is plain causal
    torch.testing.assert_close(paged_attention(q, kc, vc, meta, 0.2, window=window), out)
    full = paged_attention(q, kc, vc, meta, 0.2)
    torch.testing.assert_close(paged_attention(q, kc, vc, meta, 0.2, window=50), full)


@pytest.mark.parametrize("window", [3, 16, 21])
def test_windowed_decode_on_the_cpu(window: int) -> None:
    """bf16 decode rows (the C kernel's case when no context passes the window; the windowed
    torch path when one does) equal the reference."""
    seq_lens = [1, 9, 17, 40]
    q, kc, vc, meta = make_paged_batch([1] * 4, seq_lens, 8, 2, 64, 16, BF16, seed=window)
    out = paged_attention(q, kc, vc, meta, 0.125, window=window)
    torch.testing.assert_close(out, reference(q, kc, vc, meta, 0.125, window), **tolerance(BF16))


@pytest.mark.parametrize("window", [1, 7, 16, 30])
def test_triton_kernels_with_a_window(device: str, window: int) -> None:
    q, kc, vc, meta = make_paged_batch(*MIXED, 4, 2, 32, 8, F32, device, seed=window)
    ref = paged_attention_windowed_torch(q, kc, vc, meta, 0.2, window)
    torch.testing.assert_close(paged_prefill_attention(q, kc, vc, meta, 0.2, window=window), ref,
                               **tolerance(F32))
    seq_lens = [1, 9, 17, 40, 70]
    q, kc, vc, meta = make_paged_batch([1] * 5, seq_lens, 4, 2, 32, 8, F32, device, seed=window)
    ref = paged_attention_windowed_torch(q, kc, vc, meta, 0.2, window)
    for splits in (1, 3):  # a split wholly before the window is empty
        out = paged_decode_attention(q, kc, vc, meta, 0.2, num_splits=splits, window=window)
        torch.testing.assert_close(out, ref, **tolerance(F32))
