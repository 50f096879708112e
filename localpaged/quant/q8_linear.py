"""GGUF matrices kept as int8 blocks on the CPU (`ggml_int8.Int8Blocks`: Q8_0, and the types
converted to it once at load: Q5_0/1, Q6_K, Q5_K, IQ4 ...), multiplied through the package's
8-bit kernel (`cpu_w4.matmul_q8`, float32 activations rounded to int8 per block as llama.cpp
does). Used where the model computes in float32 on a CPU whose kernels take int8 activations.

A tied token embedding (SmolLM2's, Q8_0) is both the input table and the output layer:
`Q8Embedding` gathers rows from the same tiles that `Q8Linear` multiplies with, so the
matrix is held once, at a quarter of its float32 size.
"""

from __future__ import annotations

import torch
from torch import nn

from localpaged.quant import cpu_w4
from localpaged.quant.ggml_int8 import GgmlInt8Weight, Int8Blocks


def fits_kernel(shape: tuple[int, int], block: int) -> bool:
    """Whether a `[N, K]` matrix of `block`-value blocks fits the kernel's tiles."""
    n, k = shape
    return n % cpu_w4.TILE == 0 and block % 2 == 0 and k % block == 0


class Q8Linear(nn.Module):
    """`y = x @ W.T (+ bias)` for int8 blocks, float32 in and out (other dtypes converted)."""

    def __init__(self, tiles: torch.Tensor, tile_scales: torch.Tensor,
                 tile_offsets: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("tiles", tiles)
        self.register_buffer("tile_scales", tile_scales)
        self.register_buffer("tile_offsets", tile_offsets)
        self.bias: torch.Tensor | None = None
        self.plan_bias: torch.Tensor | None = None  # the bias in a 16-bit model's dtype (decode plan)
        self.out_features = tiles.shape[0] * cpu_w4.TILE
        self.in_features = tiles.shape[1] * 2
        self.block = self.in_features // tile_scales.shape[1]

    @classmethod
    def from_blocks(cls, w: Int8Blocks | GgmlInt8Weight) -> Q8Linear:
        if isinstance(w, GgmlInt8Weight) and w.packable(w.type_name):  # the file's blocks, in C
            return cls(*w.kernel_tiles())
        if isinstance(w, GgmlInt8Weight):
            w = w.blocks()
        return cls(*cpu_w4.pack_q8(w.codes, w.scales, w.offsets))

    @classmethod
    def from_quant_linear(cls, layer: nn.Module) -> Q8Linear:
        """The same weight from a `QuantLinear` on the own 4-bit kernel (codes 0..15 with a
        scale and offset per group), so it can join int8 layers (q/k/v of mixed types)."""
        if getattr(layer, "w4_packed", None) is None or layer.perm is not None:
            raise ValueError("only a 4-bit layer on the own kernel (no act-order) converts")
        packed, sb = cpu_w4.to_pairs(layer.w4_packed), layer.w4_sb
        t, pairs, _ = packed.shape
        codes = torch.stack((packed & 15, packed >> 4), dim=2).reshape(t, pairs * 2, cpu_w4.TILE)
        codes = codes.permute(0, 2, 1).reshape(t * cpu_w4.TILE, pairs * 2).to(torch.int8)
        s, b = sb.float().unbind(dim=2)  # [T, G, 16]
        out = cls.from_blocks(Int8Blocks(codes, s.transpose(1, 2).reshape(t * cpu_w4.TILE, -1),
                                         b.transpose(1, 2).reshape(t * cpu_w4.TILE, -1),
                                         layer.group_size))
        out.bias = None if layer.bias is None else layer.bias.float()
        return out

    def blocks(self) -> Int8Blocks:
        """The weight back as `Int8Blocks` (rows in order)."""
        t, pairs, _, _ = self.tiles.shape
        codes = self.tiles.permute(0, 3, 1, 2).reshape(t * cpu_w4.TILE, pairs * 2)

        def rows(v: torch.Tensor | None) -> torch.Tensor | None:
            return None if v is None else v.transpose(1, 2).reshape(t * cpu_w4.TILE, -1)

        return Int8Blocks(codes, rows(self.tile_scales), rows(self.tile_offsets),  # type: ignore[arg-type]
                          self.block)

    @classmethod
    def concat(cls, layers: list[nn.Module]) -> Q8Linear:
        """One layer computing the outputs of `layers` (int8 blocks, or 4-bit layers on the
        own kernel, converted) side by side, at the smallest block size among them."""
        from localpaged.quant.w6_linear import W6Linear

        def as_q8(p: nn.Module) -> Q8Linear:
            if isinstance(p, Q8Linear):
                return p
            if not isinstance(p, W6Linear):
                return cls.from_quant_linear(p)
            out = cls.from_blocks(p.blocks())
            out.bias = None if p.bias is None else p.bias.float()
            return out

        parts = [as_q8(p) for p in layers]
        if len({p.in_features for p in parts}) != 1 or len({p.bias is None for p in parts}) != 1:
            raise ValueError("layers differ in input size or bias")
        block = min(p.block for p in parts)
        if any(p.block % block for p in parts):
            raise ValueError("block sizes do not divide each other")
        blocks = [p.blocks() for p in parts]

        def widen(v: torch.Tensor, b: int) -> torch.Tensor:
            return v.repeat_interleave(b // block, dim=1)

        any_offsets = any(b.offsets is not None for b in blocks)
        codes = torch.cat([b.codes for b in blocks])
        scales = torch.cat([widen(b.scales, b.block) for b in blocks])
        offsets = (torch.cat([widen(b.offsets if b.offsets is not None else torch.zeros_like(b.scales),
                                    b.block) for b in blocks]) if any_offsets else None)
        out = cls.from_blocks(Int8Blocks(codes, scales, offsets, block))
        if parts[0].bias is not None:
            out.bias = torch.cat([p.bias.float() for p in parts])  # type: ignore[union-attr]
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = cpu_w4.matmul_q8(x.reshape(-1, self.in_features), self.tiles, self.tile_scales,
                             self.tile_offsets)
        if self.bias is not None:
            y += self.bias.float()
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int8 blocks of {self.block}{' with offsets' if self.tile_offsets is not None else ''}")


class TileEmbedding(nn.Module):
    """Rows of a weight matrix held in a kernel layer's tiles (`table`, shared with a tied
    lm_head: not a second copy) as float embeddings of `dtype`; `float_rows` reads them."""

    kind = ""

    def __init__(self, linear: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = linear
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = linear.out_features, linear.in_features

    def float_rows(self, tile: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        """The float32 rows `[n, K]` of output columns `col` of tiles `tile`."""
        raise NotImplementedError

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = cpu_w4.checked_ids(ids, self.num_embeddings)
        rows = self.float_rows(flat // cpu_w4.TILE, flat % cpu_w4.TILE)
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind}"


class Q8Embedding(TileEmbedding):
    """Rows of an int8-block matrix (in `Q8Linear`'s tiles) as float embeddings of `dtype`."""

    kind = "int8 blocks"

    def float_rows(self, tile: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        block = self.table.block
        codes = self.table.tiles[tile, :, :, col].reshape(tile.numel(), -1).float()
        rows = codes * self.table.tile_scales[tile, :, col].float().repeat_interleave(block, dim=1)
        if self.table.tile_offsets is not None:
            rows += self.table.tile_offsets[tile, :, col].repeat_interleave(block, dim=1)
        return rows
