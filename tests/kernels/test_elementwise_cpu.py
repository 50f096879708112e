"""The native CPU elementwise ops (`localpaged.kernels.elementwise_cpu`) against the torch
implementations, in bf16 (what the layers take) and float32, and the dispatch to them."""

from __future__ import annotations

import pytest
import torch

from localpaged.kernels import elementwise_cpu, native
from localpaged.kernels.activation import silu_and_mul, silu_and_mul_torch
from localpaged.kernels.rms_norm import rms_norm, rms_norm_torch
from localpaged.kernels.rotary import apply_rotary, apply_rotary_torch

pytestmark = pytest.mark.skipif(not native.has_compiler(), reason="no C compiler here to build the CPU kernels")


DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])


def _bf16(*shape: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _ulp_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to one rounding step of the dtype (the float32 sums run in another order;
    in float32, exp's polynomial differs from torch's in the last bits)."""
    assert got.dtype == ref.dtype
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), ref.float(), rtol=2**-7, atol=1e-3)


@DTYPES
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_rms_norm_matches_torch(with_residual: bool, rows: int, cpu_variant: str,
                                dtype: torch.dtype) -> None:
    x, w = _bf16(rows, 96, seed=1, dtype=dtype), _bf16(96, seed=2, dtype=dtype)
    residual = _bf16(rows, 96, seed=3, dtype=dtype) if with_residual else None
    x_before = x.clone()
    out, new_residual = elementwise_cpu.rms_norm_cpu(x, w, 1e-6, residual)
    ref_out, ref_residual = rms_norm_torch(x, w, 1e-6, residual)
    _ulp_close(out, ref_out)
    assert torch.equal(new_residual, ref_residual)  # one add, exact either way
    assert torch.equal(x, x_before)  # inputs untouched


@DTYPES
def test_silu_and_mul_matches_torch_including_large_gates(cpu_variant: str,
                                                          dtype: torch.dtype) -> None:
    x = _bf16(9, 2 * 80, seed=4, dtype=dtype) * 30  # |gate| up to ~100: no overflow nor NaN
    _ulp_close(elementwise_cpu.silu_and_mul_cpu(x), silu_and_mul_torch(x))


@DTYPES
def test_rotary_in_place_on_strided_views_matches_torch(cpu_variant: str,
                                                        dtype: torch.dtype) -> None:
    t, hq, hkv, d = 6, 4, 2, 32
    qkv = _bf16(t, (hq + 2 * hkv) * d, seed=5, dtype=dtype)
    q, k, _ = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    q, k = q.view(t, hq, d), k.view(t, hkv, d)
    positions = torch.tensor([0, 1, 5, 17, 100, 3])
    freqs = torch.outer(torch.arange(128).float(), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), -1)
    ref_q, ref_k = apply_rotary_torch(q.clone(), k.clone(), positions, cos_sin)
    assert elementwise_cpu.rotary_supports(q, k, cos_sin) == (dtype == torch.bfloat16)  # layers
    got_q, got_k = elementwise_cpu.apply_rotary_cpu(q, k, positions, cos_sin)
    assert got_q.data_ptr() == q.data_ptr()  # in place, in the qkv tensor
    _ulp_close(got_q, ref_q)
    _ulp_close(got_k, ref_k)


def test_dispatch_takes_the_native_ops_for_bf16_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    for name in ("rms_norm_cpu", "silu_and_mul_cpu"):
        original = getattr(elementwise_cpu, name)
        monkeypatch.setattr(elementwise_cpu, name,
                            lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    x = _bf16(3, 64)
    rms_norm(x, _bf16(64), 1e-6)
    silu_and_mul(x)
    assert calls == ["rms_norm_cpu", "silu_and_mul_cpu"]
    q, k = _bf16(2, 2, 16), _bf16(2, 1, 16)
    cos_sin = torch.rand(8, 16)
    assert apply_rotary(q, k, torch.tensor([1, 2]), cos_sin)[0].data_ptr() == q.data_ptr()
    rms_norm(x.float(), _bf16(64).float(), 1e-6)
    silu_and_mul(x.float())
    monkeypatch.setenv("LOCALPAGED_CPU_KERNELS", "off")
    rms_norm(x, _bf16(64), 1e-6)
    assert calls == ["rms_norm_cpu", "silu_and_mul_cpu"]  # float32 and "off": torch
