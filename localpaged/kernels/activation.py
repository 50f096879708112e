"""SiLU-and-mul: the gated MLP activation, silu(x[:, :I]) * x[:, I:]."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localpaged.kernels import elementwise_cpu
from localpaged.kernels._triton import jit, next_pow2, require_triton, tl
from localpaged.kernels.backend import use_triton


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """Torch implementation: x is [T, 2*I], returns [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (row, chunk): out = silu(gate) * up, silu in float32 rounded like F.silu."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.0)
    ty = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(ty)
    tl.store(out_ptr + row * stride_o + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(ty),
             mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton implementation of `silu_and_mul_torch`, x: [..., 2*I] -> [..., I]."""
    require_triton()
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(next_pow2(inter), 1024)
        grid = (x2.shape[0], -(-inter // block))
        _silu_and_mul_kernel[grid](x2, out, x2.stride(0), out.stride(0), INTER=inter, BLOCK=block)
    return out.view(*x.shape[:-1], inter)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = cat(gate, up) along the last dim."""
    if use_triton(x):
        return silu_and_mul_triton(x)
    if elementwise_cpu.supports(x):
        return elementwise_cpu.silu_and_mul_cpu(x)
    return silu_and_mul_torch(x)
