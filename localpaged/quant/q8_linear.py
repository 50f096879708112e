"""GGUF Q8_0 matrices kept in their bits on the CPU: 32 int8 codes per block, one float16
scale each (`W = codes * scale`), multiplied through the package's int8 kernel
(`cpu_w4.matmul_q8`, float32 activations rounded to int8 per block as llama.cpp does).

A tied token embedding in Q8_0 (SmolLM2's) is both the input table and the output layer:
`Q8Embedding` gathers rows from the same tiles that `Q8Linear` multiplies with, so the
matrix is held once, at a quarter of its float32 size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from localpaged.quant import cpu_w4

BLOCK = cpu_w4.Q8_BLOCK
_Q8_0 = np.dtype([("d", "<f2"), ("qs", "i1", (BLOCK,))])  # ggml's block_q8_0, 34 bytes


@dataclass
class Q8Weight:
    """A Q8_0 matrix `[N, K]`: int8 `codes` and float16 `scales` `[N, K/32]`."""

    codes: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def from_gguf_bytes(cls, data: np.ndarray, shape: tuple[int, int]) -> Q8Weight:
        """From a GGUF tensor's raw Q8_0 blocks (`shape` = (rows, columns) as torch has it)."""
        n, k = shape
        blocks = np.frombuffer(np.ascontiguousarray(data).tobytes(), dtype=_Q8_0)
        if blocks.size != n * k // BLOCK or k % BLOCK:
            raise ValueError(f"Q8_0 data of {blocks.size} blocks does not hold {n} x {k}")
        codes = torch.from_numpy(blocks["qs"].reshape(n, k).copy())
        scales = torch.from_numpy(blocks["d"].reshape(n, k // BLOCK).copy())
        return cls(codes, scales)

    def dequantize(self) -> torch.Tensor:
        """The matrix in float32."""
        return self.codes.float() * self.scales.float().repeat_interleave(BLOCK, dim=1)


def fits_kernel(shape: tuple[int, int]) -> bool:
    """Whether a `[N, K]` Q8_0 matrix fits the kernel's tiles (N % 16, K % 32)."""
    n, k = shape
    return n % cpu_w4.TILE == 0 and k % BLOCK == 0


class Q8Linear(nn.Module):
    """`y = x @ W.T` for a Q8_0 weight, float32 in and out (other dtypes are converted)."""

    def __init__(self, tiles: torch.Tensor, tile_scales: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("tiles", tiles)
        self.register_buffer("tile_scales", tile_scales)
        self.out_features = tiles.shape[0] * cpu_w4.TILE
        self.in_features = tiles.shape[1] * 2

    @classmethod
    def from_weight(cls, w: Q8Weight) -> Q8Linear:
        return cls(*cpu_w4.pack_q8(w.codes, w.scales))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = cpu_w4.matmul_q8(x.reshape(-1, self.in_features), self.tiles, self.tile_scales)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, Q8_0"


class Q8Embedding(nn.Module):
    """Rows of a Q8_0 matrix (in `Q8Linear`'s tiles) as float embeddings of `dtype`."""

    def __init__(self, linear: Q8Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = linear  # shared with a tied lm_head: not a second copy
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = linear.out_features, linear.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        tile, col = flat // cpu_w4.TILE, flat % cpu_w4.TILE
        codes = self.table.tiles[tile, :, :, col].reshape(flat.numel(), -1).float()
        scales = self.table.tile_scales[tile, :, col].float()
        rows = codes * scales.repeat_interleave(BLOCK, dim=1)
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, Q8_0 (shared with the output layer)"
