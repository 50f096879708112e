"""`Int8Linear`: a weight-only int8 `nn.Linear` for the CPU (per-output-channel scales), made
for the lm_head of quantized models. A decode step reads the whole weight per token, so half
the bytes of bf16 is about half the time.

* One or two rows: torch's int8 op (`aten._weight_int8pack_mm`), the fastest there.
* More rows: the package's kernels, which unpack each weight tile once for all rows (torch's
  op slows down with every row): through int8 activations per block where the build has them
  and no AMX (`cpu_w4.matmul_q8`, as GGUF's Q8_0 heads), else in bf16 (`cpu_w4.matmul_w8`). Without the kernel,
  batches of `dense_min_rows` rows and more use the dense 16-bit weight (kept by reference,
  e.g. the tied embedding).
"""

from __future__ import annotations

import torch
from torch import nn

from localpaged.quant import cpu_w4

TORCH_OP_MAX_ROWS = 2  # measured on SmolLM2's 49152 x 576 head


def _int8_activations_win() -> bool:
    """Whether this build multiplies through int8 activations and has no AMX (whose bf16
    tiles serve the 8-bit codes exactly and fast)."""
    from localpaged.kernels import cpu_isa

    return cpu_w4.int8_activations() and cpu_isa.chosen() != "amx"


def quantize_rows(weight: torch.Tensor, tiled: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(int8 codes, float32 scales, the 8-bit kernel's tiles or None) of a 16-bit `weight`
    `[N, K]` per output row: scale = max|w| / 127, codes = w / scale rounded. bf16 in one C
    pass where the library is here (`rows_to_int8`: the same bytes), else torch ops."""
    from localpaged.kernels import native

    n, k = weight.shape
    lib = native.library()
    if lib is not None and weight.dtype == torch.bfloat16:
        w = weight.contiguous()
        codes = torch.empty(n, k, dtype=torch.int8)
        scale = torch.empty(n, dtype=torch.float32)
        tiles = torch.empty(n // cpu_w4.TILE, k // 2, 2, cpu_w4.TILE, dtype=torch.int8) if tiled else None
        lib.rows_to_int8(w.data_ptr(), n, k, codes.data_ptr(), scale.data_ptr(),
                         tiles.data_ptr() if tiles is not None else None, torch.get_num_threads())
        return codes, scale, tiles
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    codes = torch.round(w / scale[:, None]).to(torch.int8)
    return codes, scale, cpu_w4.pack_w8(codes) if tiled else None


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
        tiled = (self.out_features % cpu_w4.TILE == 0 and self.in_features % 2 == 0
                 and cpu_w4.available())
        codes, scale, tiles = quantize_rows(weight.detach(), tiled)
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scale.to(weight.dtype))
        self.dense = weight.detach()
        self.dense_min_rows = dense_min_rows
        self.register_buffer("tiles", tiles)
        self.register_buffer("tile_scales", self.scales.float() if tiled else None)
        # Where products go through int8 activations (no AMX): the same tiles as 8-bit blocks
        # of Q8_BLOCK, each row's scale in each of its blocks (pack_q8's layout, +1/8 of the
        # codes' bytes), multiplied as GGUF's Q8_0 heads are. Qwen2.5-1.5B's head at 8 / 16
        # rows: 21 / 34 -> 9 / 13 ms.
        self.register_buffer("q8_scales", None)
        if tiled and self.in_features % cpu_w4.Q8_BLOCK == 0 and _int8_activations_win():
            n, blocks = self.out_features, self.in_features // cpu_w4.Q8_BLOCK
            self.q8_scales = cpu_w4.tile_blocks(self.tile_scales.view(n, 1).expand(n, blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(self.dtype)
        rows = x2.shape[0]
        if self.q8_scales is not None and rows > TORCH_OP_MAX_ROWS:
            y = cpu_w4.matmul_q8(x2, self.tiles, self.q8_scales).to(self.dtype)
        elif self.tiles is not None and rows > TORCH_OP_MAX_ROWS and self.dtype == torch.bfloat16:
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
