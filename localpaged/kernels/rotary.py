"""Rotary position embedding (NeoX / HF "rotate_half" layout) applied to q and k.

`cos_sin` is a [max_positions, rotary_dim] table: cos in the first half of the last dim,
sin in the second (built by `localpaged.model.rope`, which owns the rope-scaling kinds).
"""

from __future__ import annotations

import torch

from localpaged.kernels.backend import use_triton


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos/sin: [T, 1, D/2]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def apply_rotary_torch(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch implementation. q: [T, Hq, D], k: [T, Hkv, D], positions: [T]."""
    cs = cos_sin.index_select(0, positions).unsqueeze(1)
    cos, sin = cs.float().chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] by their token positions. Returns (q, k); the
    Triton path rotates in place and returns the same tensors."""
    if use_triton(q):
        from localpaged.kernels.triton_ops import apply_rotary_triton

        return apply_rotary_triton(q, k, positions, cos_sin)
    return apply_rotary_torch(q, k, positions, cos_sin)
