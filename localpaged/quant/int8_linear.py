"""`Int8Linear`: a weight-only int8 `nn.Linear` for the CPU (per-output-channel scales), made
for the lm_head of quantized models. A decode step reads the whole weight per token, so half
the bytes of bf16 is about half the time.

* One or two rows: torch's int8 op (`aten._weight_int8pack_mm`), the fastest there.
* More rows: the package's kernel (`localpaged.quant.cpu_w4.matmul_w8`), which unpacks each
  weight tile once for all rows; torch's op slows down with every row. Without the kernel,
  batches of `dense_min_rows` rows and more use the dense 16-bit weight (kept by reference,
  e.g. the tied embedding).
"""

from __future__ import annotations

import torch
from torch import nn

from localpaged.quant import cpu_w4

TORCH_OP_MAX_ROWS = 2  # measured on SmolLM2's 49152 x 576 head


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
        self.register_buffer("tiles", None)
        self.register_buffer("tile_scales", None)
        if self.out_features % cpu_w4.TILE == 0 and self.in_features % 2 == 0 and cpu_w4.available():
            self.tiles = cpu_w4.pack_w8(self.codes)
            self.tile_scales = self.scales.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(self.dtype)
        rows = x2.shape[0]
        if self.tiles is not None and rows > TORCH_OP_MAX_ROWS and self.dtype == torch.bfloat16:
            y = cpu_w4.matmul_w8(x2, self.tiles, self.tile_scales)
        elif rows >= self.dense_min_rows:
            y = torch.nn.functional.linear(x2, self.dense)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.codes, self.scales)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        wide = ("own kernel for > 2 rows" if self.tiles is not None
                else f"dense for >= {self.dense_min_rows} rows")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int8 per channel, {wide}")
