"""SiLU-and-mul: the gated MLP activation, silu(x[:, :I]) * x[:, I:]."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localpaged.kernels.backend import use_triton


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """Torch implementation: x is [T, 2*I], returns [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = cat(gate, up) along the last dim."""
    if use_triton(x):
        from localpaged.kernels.triton_ops import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return silu_and_mul_torch(x)
