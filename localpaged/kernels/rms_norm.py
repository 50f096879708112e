"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch

from localpaged.kernels import elementwise_cpu
from localpaged.kernels._triton import jit, next_pow2, require_triton, tl
from localpaged.kernels.backend import use_triton


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch implementation. Returns (normed, new_residual) where new_residual = x + residual
    (or x when residual is None). Computes in float32 like HF's LlamaRMSNorm."""
    if residual is not None:
        x = x + residual
    residual_out = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), residual_out


@jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    eps, N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    """One program per row: s = x + r (rounded to x's dtype), out = w * (s * rsqrt(mean(s^2)))."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out_ty = out_ptr.dtype.element_ty
    # Product of the weight and the rounded norm, both in out_ty, computed in fp32 and rounded
    # once (what torch does for w * x; also avoids bf16 arithmetic in the interpreter).
    y = w.to(out_ty).to(tl.float32) * normed.to(out_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of `rms_norm_torch` (same return contract), x: [..., N]."""
    require_triton()
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty_like(x2)
    else:
        r2, res_out = x2, x2
    rows = x2.shape[0]
    if rows:
        block = next_pow2(n)
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out, res_out,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            eps, N=n, BLOCK=block, HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block // 256)),
        )
    new_residual = res_out.view(x.shape) if residual is not None else x
    return out.view(x.shape), new_residual


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual); residual may be None."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    if elementwise_cpu.supports(x):
        return elementwise_cpu.rms_norm_cpu(x, weight, eps, residual)
    return rms_norm_torch(x, weight, eps, residual)
