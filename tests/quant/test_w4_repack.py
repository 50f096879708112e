"""The C repacks of AWQ / GPTQ words (kernels/cpu/w4_repack.c) against layout.py's torch
ops on the same words: the internal layout, act-order's row gather, the kernel's pairs."""

from __future__ import annotations

import pytest
import torch

from localpaged.kernels import native
from localpaged.quant import cpu_w4
from localpaged.quant.formats import AWQ_ORDER
from localpaged.quant.layout import (
    Int4Weight,
    awq_to_internal,
    gather_rows,
    pack_nibbles,
    unpack_nibbles,
)

pytestmark = pytest.mark.skipif(not native.available(), reason="the C kernels do not build here")


def _words(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31, shape, dtype=torch.int64, generator=g).to(torch.int32)


@pytest.mark.parametrize(("k", "n"), [(8, 8), (64, 48), (136, 160)])
def test_awq_words_become_the_internal_layout(k: int, n: int) -> None:
    qweight = _words(k, n // 8, seed=k + n)
    got = awq_to_internal(qweight)
    want = pack_nibbles(unpack_nibbles(qweight, 1, AWQ_ORDER), 0)
    assert got.dtype == torch.int32 and torch.equal(got, want)


@pytest.mark.parametrize(("k", "n"), [(8, 16), (128, 40), (264, 96)])
def test_gathered_rows_match_the_codes_permuted(k: int, n: int) -> None:
    qweight = _words(k // 8, n, seed=k * n)
    rows = torch.randperm(k, generator=torch.Generator().manual_seed(k))
    got = gather_rows(qweight, rows)
    want = pack_nibbles(unpack_nibbles(qweight, 0)[rows], 0)
    assert torch.equal(got, want)
    assert torch.equal(unpack_nibbles(got, 0), unpack_nibbles(qweight, 0)[rows])


@pytest.mark.parametrize(("k", "n"), [(32, 16), (256, 64)])
def test_kernel_pairs_from_the_internal_words(k: int, n: int, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    w = Int4Weight(_words(k // 8, n, seed=n), torch.rand(k // 32, n), torch.rand(k // 32, n), 32)
    packed, sb = cpu_w4.pack(w)  # in C
    monkeypatch.setenv("LOCALPAGED_CPU_KERNELS", "off")
    packed_ref, sb_ref = cpu_w4.pack(w)  # torch's ops
    assert packed.shape == (n // 16, k // 2, 16)
    assert torch.equal(packed, packed_ref) and torch.equal(sb, sb_ref)
