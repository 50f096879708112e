"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch

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


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual); residual may be None."""
    if use_triton(x):
        from localpaged.kernels.triton_ops import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_torch(x, weight, eps, residual)
