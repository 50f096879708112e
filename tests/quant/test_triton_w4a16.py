"""The Triton W4A16 kernel (interpreter on the CPU, compiled on CUDA) against the torch
dequantize-then-matmul reference: decode and prefill shapes, group sizes, act-order."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from localpaged.kernels._triton import HAS_TRITON, interpreter_active
from localpaged.quant.layout import from_codes
from localpaged.quant.linear import QuantLinear

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def _device() -> str:
    if interpreter_active() or not torch.cuda.is_available():
        return "cpu"
    return "cuda"


def _weight(k: int, n: int, gs: int, seed: int, act_order: bool = False):
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // gs)
    codes = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    scales = torch.rand(groups, n, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 16, (groups, n), generator=g).float()
    g_idx = (torch.arange(k) // gs)[torch.randperm(k, generator=g)] if act_order else None
    return from_codes(codes, scales, zeros, gs, g_idx)


@pytest.mark.parametrize(
    ("m", "k", "n", "gs"),
    [(1, 64, 64, 32), (3, 128, 96, 64), (16, 64, 48, 64), (40, 96, 64, 32), (33, 64, 32, 64)],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_matches_reference(m: int, k: int, n: int, gs: int, dtype: torch.dtype) -> None:
    from localpaged.quant.triton_w4a16 import w4a16_matmul

    dev = _device()
    w = _weight(k, n, gs, seed=m + k + n).to(dev, dtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dev, dtype)
    out = w4a16_matmul(x, w.qweight, w.scales, w.zeros, w.group_size)
    ref = x.float() @ w.dequantize().t()
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.usefixtures("exact_float32")  # the CPU reference in float32 as it is
def test_quant_linear_act_order_through_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """QuantLinear's non-CPU-op path (the kernel on CUDA; here the dequant fallback on the
    CPU with LOCALPAGED_INT4_CPU=dequant) keeps act-order's permutation right."""
    monkeypatch.setenv("LOCALPAGED_INT4_CPU", "dequant")
    w = _weight(64, 32, 32, seed=5, act_order=True)
    assert w.perm is not None
    bias = torch.randn(32)
    layer = QuantLinear.from_int4(w, bias, torch.float32, "cpu")
    assert layer.cpu_packed is None
    x = torch.randn(2, 7, 64)
    ref = x @ w.dequantize().t() + bias
    torch.testing.assert_close(layer(x), ref, atol=1e-5, rtol=1e-5)
    monkeypatch.setenv("LOCALPAGED_INT4_CPU", "int4")
    assert QuantLinear.from_int4(w, bias, torch.float32, "cpu").cpu_packed is None  # exact path
    fast = QuantLinear.from_int4(w, bias, torch.bfloat16, "cpu")
    assert fast.cpu_packed is not None or fast.w4_packed is not None  # a CPU packing
    torch.testing.assert_close(fast(x), ref, atol=0.05, rtol=0.02)
