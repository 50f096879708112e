"""Layers of one input computed side by side, each kept in its own form.

Fusing q/k/v (or gate/up) into one matrix saves kernel calls, but a fused CPU matrix has one
form: parts of different GGUF types are widened to one that holds them all. In a Q4_K_M file
half the layers have q and k in Q4_K and v in Q6_K, and one 6-bit matrix with a scale and an
offset per 16 values takes 8 bits a weight where the parts take 4.6 and 7 (1.7B: 50 MiB more
to read every decode step, 5% of the model). `JoinedLinear` keeps the parts as they are; the
native decode layer runs them one after another into their columns.
"""

from __future__ import annotations

import torch
from torch import nn


def _form(layer: nn.Module) -> tuple | None:
    """What decides a CPU layer's bytes a weight when joined: equal forms join exactly."""
    from localpaged.quant.q8_linear import Q8Linear
    from localpaged.quant.w6_linear import W6Linear

    if isinstance(layer, W6Linear):
        return ("6-bit", layer.zero_point, layer.high is None, layer.group_size,
                layer.bias is None)
    if isinstance(layer, Q8Linear):
        return ("int8", layer.block, layer.tile_scales.dtype, layer.tile_offsets is None,
                layer.bias is None)
    return None


def joins_exactly(layers: list[nn.Module]) -> bool:
    """Whether `layers` include no CPU-form layer (6-bit / int8 blocks), or are all of one
    such form, so that one fused matrix holds them in their own bytes."""
    forms = [_form(layer) for layer in layers]
    if all(f is None for f in forms):
        return True
    return None not in forms and len(set(forms)) == 1


class JoinedLinear(nn.Module):
    """`y = [part_0(x) | part_1(x) | ...]`: the parts' outputs side by side."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("joined layers must share their input size")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None  # each part adds its own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
