"""`Int8Linear`: a weight-only int8 `nn.Linear` for the CPU (per-output-channel scales), made
for the lm_head of quantized models. At one to a few rows (a decode step) the matmul reads the
whole weight per token, so half the bytes of bf16 is about half the time; for many rows a dense
16-bit weight (kept or shared, e.g. the tied embedding) is faster and is used instead.
"""

from __future__ import annotations

import torch
from torch import nn


class Int8Linear(nn.Module):
    """`y = x @ W.T` with W stored as int8 codes times a per-row scale."""

    def __init__(self, weight: torch.Tensor, dense_min_rows: int) -> None:
        """Quantize `weight` [N, K] (16-bit, CPU). Inputs of >= `dense_min_rows` rows use
        `weight` itself, which is kept by reference (no copy when it is shared)."""
        super().__init__()
        if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError("Int8Linear takes a 16-bit CPU weight")
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self.register_buffer("codes", torch.round(w / scale[:, None]).to(torch.int8))
        self.register_buffer("scales", scale.to(weight.dtype))
        self.dense = weight.detach()
        self.dense_min_rows = dense_min_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(self.dtype)
        if x2.shape[0] >= self.dense_min_rows:
            y = torch.nn.functional.linear(x2, self.dense)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.codes, self.scales)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int8 per channel, dense for >= {self.dense_min_rows} rows")
