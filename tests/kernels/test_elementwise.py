"""KV write, fused residual + RMSNorm, rotary and SiLU-and-mul: Triton vs torch."""

from __future__ import annotations

import pytest
import torch

from localpaged.kernels.activation import silu_and_mul_torch, silu_and_mul_triton
from localpaged.kernels.kv_write import write_kv_torch, write_kv_triton
from localpaged.kernels.rms_norm import rms_norm_torch, rms_norm_triton
from localpaged.kernels.rotary import apply_rotary_torch, apply_rotary_triton
from localpaged.kernels.testing import tolerance

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _randn(*shape: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "num_kv_heads", "head_dim"), [(8, 1, 64), (16, 3, 128),
                                                                       (16, 2, 80)])
def test_write_kv(device: str, dtype: torch.dtype, block_size: int, num_kv_heads: int,
                  head_dim: int) -> None:
    num_blocks, t = 5, 9
    k_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device,
                     seed=1)
    gen = torch.Generator().manual_seed(2)
    # Scattered slots: first and last offsets of blocks, in no particular order.
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    slots[:2] = torch.tensor([block_size - 1, 3 * block_size])
    slots = slots.to(device)
    key = _randn(t, num_kv_heads, head_dim, dtype=dtype, device=device, seed=3)
    value = _randn(t, num_kv_heads, head_dim, dtype=dtype, device=device, seed=4)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv_torch(key, value, ref_k, ref_v, slots)
    write_kv_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_write_kv_skips_negative_slots_and_strided_input(device: str) -> None:
    k_cache = torch.zeros(2, 8, 2, 64, device=device)
    v_cache = torch.zeros_like(k_cache)
    kv = _randn(3, 2, 2, 64, dtype=torch.float32, device=device)  # key, value interleaved
    key, value = kv[:, 0], kv[:, 1]  # non-contiguous views
    write_kv_triton(key, value, k_cache, v_cache, torch.tensor([5, -1, 9], device=device))
    assert torch.equal(k_cache.view(-1, 2, 64)[5], key[0])
    assert torch.equal(v_cache.view(-1, 2, 64)[9], value[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2  # the -1 row wrote nothing


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 80])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(device: str, dtype: torch.dtype, hidden: int, with_residual: bool) -> None:
    x = _randn(6, hidden, dtype=dtype, device=device)
    residual = _randn(6, hidden, dtype=dtype, device=device, seed=1) if with_residual else None
    weight = _randn(hidden, dtype=dtype, device=device, seed=2)
    out, new_res = rms_norm_triton(x, weight, 1e-6, residual)
    ref_out, ref_res = rms_norm_torch(x, weight, 1e-6, residual)
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    torch.testing.assert_close(out, ref_out, **tolerance(dtype))
    torch.testing.assert_close(new_res, ref_res, **tolerance(dtype))
    if not with_residual:
        assert new_res is x


def test_rms_norm_fp32_weight_promotes_and_3d_input(device: str) -> None:
    x = _randn(2, 3, 64, dtype=torch.float16, device=device)
    weight = _randn(64, dtype=torch.float32, device=device, seed=1)
    residual = _randn(2, 3, 64, dtype=torch.float16, device=device, seed=2)
    out, new_res = rms_norm_triton(x, weight, 1e-5, residual)
    ref_out, ref_res = rms_norm_torch(x, weight, 1e-5, residual)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 64)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 64), (3, 1, 128),
                                                                      (8, 1, 64), (6, 2, 80)])
def test_rotary_in_place_on_views(device: str, dtype: torch.dtype, num_heads: int,
                                  num_kv_heads: int, head_dim: int) -> None:
    t, max_pos = 7, 40
    # q and k as views into a fused qkv projection output (strided rows).
    qkv = _randn(t, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device)
    q = qkv[:, : num_heads * head_dim].view(t, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    k = k.view(t, num_kv_heads, head_dim)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()
    freqs = torch.outer(torch.arange(max_pos).float(), torch.rand(head_dim // 2) + 0.1)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), -1).to(device)
    positions = torch.tensor([0, 1, 39, 5, 5, 17, 2], device=device)
    ref_q, ref_k = apply_rotary_torch(q, k, positions, cos_sin)
    out_q, out_k = apply_rotary_triton(q, k, positions, cos_sin)
    assert out_q is q and out_k is k
    torch.testing.assert_close(q, ref_q, **tolerance(dtype))
    torch.testing.assert_close(k, ref_k, **tolerance(dtype))
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim :], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_partial_rotary_rotates_the_first_dims_only(device: str, dtype: torch.dtype) -> None:
    """A table narrower than head_dim (Phi-4-mini: 96 of 128): those dims rotate as a head of
    that width would (the pairs are i and i + 48), the others pass through; Triton equals
    torch, which equals rotating the slice alone."""
    t, rot = 5, 48
    q = _randn(t, 3, 64, dtype=dtype, device=device)
    k = _randn(t, 1, 64, dtype=dtype, device=device, seed=1)
    freqs = torch.outer(torch.arange(30).float(), torch.rand(rot // 2) + 0.1)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), -1).to(device)
    positions = torch.tensor([0, 3, 29, 7, 7], device=device)
    slice_q, slice_k = apply_rotary_torch(q[..., :rot].contiguous(), k[..., :rot].contiguous(),
                                          positions, cos_sin)
    ref_q, ref_k = apply_rotary_torch(q, k, positions, cos_sin)
    assert torch.equal(ref_q[..., :rot], slice_q) and torch.equal(ref_k[..., :rot], slice_k)
    assert torch.equal(ref_q[..., rot:], q[..., rot:]) and torch.equal(ref_k[..., rot:], k[..., rot:])
    apply_rotary_triton(q, k, positions, cos_sin)
    torch.testing.assert_close(q, ref_q, **tolerance(dtype))
    torch.testing.assert_close(k, ref_k, **tolerance(dtype))
    with pytest.raises(ValueError, match="even and at most head_dim"):
        apply_rotary_triton(q, k, positions, torch.zeros(30, 66, device=device))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 100])
def test_silu_and_mul(device: str, dtype: torch.dtype, inter: int) -> None:
    x = _randn(5, 2 * inter, dtype=dtype, device=device) * 3
    out = silu_and_mul_triton(x)
    torch.testing.assert_close(out, silu_and_mul_torch(x), **tolerance(dtype))
    x3 = x.view(5, 1, 2 * inter)
    assert silu_and_mul_triton(x3).shape == (5, 1, inter)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_llama3_scaled_table_at_long_positions(device: str, dtype: torch.dtype) -> None:
    """Llama 3 rope scaling lives in the table (localpaged.model.rope); the kernel reads it."""
    from localpaged.model.config import ModelConfig
    from localpaged.model.rope import build_cos_sin

    config = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=8, hidden_size=256, intermediate_size=8,
        num_layers=1, num_heads=2, num_kv_heads=1, head_dim=128, rope_theta=500000.0,
        max_position_embeddings=8192,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    cos_sin = build_cos_sin(config, device)
    q = _randn(4, 2, 128, dtype=dtype, device=device)
    k = _randn(4, 1, 128, dtype=dtype, device=device, seed=1)
    positions = torch.tensor([0, 1, 4097, 8191], device=device)
    ref_q, ref_k = apply_rotary_torch(q, k, positions, cos_sin)
    apply_rotary_triton(q, k, positions, cos_sin)
    torch.testing.assert_close(q, ref_q, **tolerance(dtype))
    torch.testing.assert_close(k, ref_k, **tolerance(dtype))
