"""GGUF matrices kept in (nearly) their file's bits on the CPU's quads layout (`cpu_w6`), so
a decode step, which reads every weight once, reads less: Q6_K, Q5_0, Q5_1 and Q5_K in their
6-bit codes (7 bits a weight for Q6_K and Q5_1, 6.5 for Q5_0, 6.625 for Q5_K with its own
super-block scales, where int8 blocks take 9-10), Q4_0 with its scales alone (4.5), Q4_K
with its super-block scales (4.625), where the 4-bit layer's float16 scale and offset per
group take 5, and IQ4_NL and IQ4_XS with their 4-bit codes into their code book and float16
scales alone (4.5, where int8 blocks take 9; IQ4_XS's d * (ls - 32) rounded to float16, as
Q6_K's d * sc is). Parts of one form fuse into one layer (`concat`); parts of different forms
(a Q4_K_M file's q/k/v, with v in Q6_K) are joined side by side instead (`joined_linear`),
each keeping its own bytes.

A tied token embedding (Q6_K in most K-quant files) is both the input table and the output
layer: `W6Embedding` gathers rows from the layer's own bytes.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from localpaged.quant import cpu_w4, cpu_w6
from localpaged.quant.ggml_int8 import GgmlInt8Weight, Int8Blocks
from localpaged.quant.q8_linear import TileEmbedding

W6_TYPES = {"Q5_0": 32, "Q5_1": 32, "Q5_K": 32, "Q6_K": 16}  # type -> group size
ZERO_POINTS = {"Q4_0": 8, "Q5_0": 16, "Q6_K": 32}  # the symmetric types: W = (q - zp) * scale
CODE_BOOK_TYPES = ("IQ4_NL", "IQ4_XS")  # 4-bit codes into kvalues_iq4nl: zero point NL
KEPT_TYPES = {**W6_TYPES, "IQ4_NL": 32, "IQ4_XS": 32}  # the GGUF types `from_gguf` takes


def wanted(type_name: str, shape: tuple[int, int]) -> bool:
    """Whether a GGUF matrix of `type_name` and `shape` `[N, K]` takes this layout here
    (6-bit codes, or IQ4_NL's 4-bit ones)."""
    gs = KEPT_TYPES.get(type_name)
    return gs is not None and cpu_w6.fits(*shape, gs) and cpu_w6.available()


def four_bit_wanted(w: object, dtype: torch.dtype) -> bool:
    """Whether a GGUF 4-bit matrix (`GgmlInt4Weight`) is Q4_0 or Q4_K for a layer computing
    in `dtype` that takes the quads layout anyway: then Q4_0 keeps symmetric groups (4.5 bits
    a weight, the file's) and Q4_K its super-block scales (4.625), where the 4-bit layer's
    float16 scale and offset per group make 5."""
    from localpaged.quant.ggml_int4 import GgmlInt4Weight

    return (isinstance(w, GgmlInt4Weight) and w.type_name in ("Q4_0", "Q4_K")
            and w.in_features % (256 if w.type_name == "Q4_K" else 32) == 0
            and cpu_w6.available() and cpu_w4.quads_wanted(dtype))


def from_four_bit(w: object) -> W6Linear:
    """The layer for a matrix `four_bit_wanted` takes."""
    return W6Linear.from_q4_0(w) if w.type_name == "Q4_0" else W6Linear.from_q4_k(w)  # type: ignore[attr-defined]


class W6Linear(nn.Module):
    """`y = x @ W.T (+ bias)` for the 6-bit layout (or the 4-bit quads layout with symmetric
    groups, `high` None); float32 or bf16 in and out."""

    def __init__(self, packed: torch.Tensor, high: torch.Tensor | None, sb: torch.Tensor,
                 zero_point: int = 0) -> None:
        super().__init__()
        if zero_point == cpu_w6.KQ:
            if sb.dim() != 3 or sb.shape[2] != cpu_w6.KQ_RECORD:
                raise ValueError("super-block scales are records of 160 per 256 values")
        elif (sb.shape[2] == 1) != (zero_point != 0):
            raise ValueError("scales alone need a zero point, scales and offsets none")
        if zero_point == cpu_w6.NL and high is not None:
            raise ValueError("IQ4_NL's code book takes 4-bit codes (no top bits)")
        self.register_buffer("packed", packed)
        self.register_buffer("high", high)
        self.register_buffer("sb", sb)
        self.zero_point = zero_point
        self.bias: torch.Tensor | None = None
        self.out_features = packed.shape[0] * cpu_w4.TILE
        self.in_features = packed.shape[1] * 4
        self.group_size = cpu_w6.group_size(packed, sb, zero_point)

    @classmethod
    def from_gguf(cls, w: GgmlInt8Weight) -> W6Linear:
        """A GGUF matrix of one of `KEPT_TYPES` packed in C from the file's blocks (a
        symmetric type keeps its scales alone, Q5_K its super-block scales)."""
        n, k = w.shape
        t = n // cpu_w4.TILE
        if w.type_name in CODE_BOOK_TYPES:  # the 4-bit packer, the offsets (-128 s) dropped
            packed = torch.empty(t, k // 4, 2 * cpu_w4.TILE, dtype=torch.uint8)
            sb = torch.empty(t, k // 32, 2, cpu_w4.TILE, dtype=torch.float16)
            cpu_w4.gguf_pack("gguf_q4_pack", w.type_name, w.data, w.rows, n, k,
                             packed.data_ptr(), sb.data_ptr(), 1)
            return cls(packed, None, sb[:, :, :1].contiguous(), cpu_w6.NL)
        if w.type_name == "Q5_K":  # its own super-block scales, as Q4_K's
            return cls._from_k_blocks("Q5_K", w.data, w.rows, n, k)
        zp = ZERO_POINTS.get(w.type_name, 0)
        packed = torch.empty(t, k // 4, 2 * cpu_w4.TILE, dtype=torch.uint8)
        high = torch.empty(t, k // 8, 2 * cpu_w4.TILE, dtype=torch.uint8)
        sb = torch.empty(t, k // W6_TYPES[w.type_name], 1 if zp else 2, cpu_w4.TILE,
                         dtype=torch.float16)
        cpu_w4.gguf_pack("gguf_w6_pack", w.type_name, w.data, w.rows, n, k, packed.data_ptr(),
                         high.data_ptr(), sb.data_ptr(), int(zp > 0))
        return cls(packed, high, sb, zp)

    @classmethod
    def from_q4_0(cls, w: object) -> W6Linear:
        """A GGUF Q4_0 matrix (`GgmlInt4Weight`) in the quads layout, its scales alone (its
        offsets are -8 * d)."""
        packed, sb = w.cpu_w4_pack(quads=True)  # type: ignore[attr-defined]
        return cls(packed, None, sb[:, :, :1].contiguous(), ZERO_POINTS["Q4_0"])

    @classmethod
    def from_q4_k(cls, w: object) -> W6Linear:
        """A GGUF Q4_K matrix (`GgmlInt4Weight`) in the quads layout with its super-block
        scales, packed in C from the file's blocks."""
        type_name, data, rows = w._blocks  # type: ignore[attr-defined]
        return cls._from_k_blocks(type_name, data, rows, w.out_features, w.in_features)  # type: ignore[attr-defined]

    @classmethod
    def _from_k_blocks(cls, type_name: str, data: np.ndarray, rows: np.ndarray, n: int, k: int
                       ) -> W6Linear:
        """A Q4_K or Q5_K matrix `[n, k]` packed in C with its super-block scales (Q5_K's
        fifth bits in the top-bit plane)."""
        t = n // cpu_w4.TILE
        packed = torch.empty(t, k // 4, 2 * cpu_w4.TILE, dtype=torch.uint8)
        high = (torch.empty(t, k // 8, 2 * cpu_w4.TILE, dtype=torch.uint8)
                if type_name == "Q5_K" else None)
        sb = torch.empty(t, k // 256, cpu_w6.KQ_RECORD, dtype=torch.int16)
        cpu_w4.gguf_pack("gguf_q4k_pack_kq", type_name, data, rows, n, k, packed.data_ptr(),
                         None if high is None else high.data_ptr(), sb.data_ptr())
        return cls(packed, high, sb, cpu_w6.KQ)

    @classmethod
    def from_quant_linear(cls, layer: nn.Module) -> W6Linear:
        """The same weight from a `QuantLinear` on the own 4-bit kernel (no act-order): its
        nibbles in the quads layout, no top bits, the same scales and offsets."""
        if getattr(layer, "w4_packed", None) is None or layer.perm is not None:
            raise ValueError("only a 4-bit layer on the own kernel (no act-order) converts")
        packed = layer.w4_packed
        if not cpu_w4.is_quads(packed):
            packed = cpu_w4.to_quads(packed)
        out = cls(packed, None, layer.w4_sb)
        out.bias = layer.bias
        return out

    def scales_offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-group float32 (scales, offsets) `[N, K/gs]`."""
        return cpu_w6.scales_offsets(self.sb, self.zero_point)

    def blocks(self) -> Int8Blocks:
        """The weight as `Int8Blocks` (codes 0..63 with float32 scales and offsets, or
        IQ4_NL's signed values with scales alone), rows in order."""
        s, o = self.scales_offsets()
        codes = cpu_w6.codes_of(self.packed, self.high)
        if self.zero_point == cpu_w6.NL:
            signed = cpu_w6.values_of(codes, cpu_w6.NL).to(torch.int16) - 128
            return Int8Blocks(signed.to(torch.int8), s, None, self.group_size, "IQ4_NL")
        return Int8Blocks(codes.to(torch.int8), s, o, self.group_size, "6-bit")

    @staticmethod
    def joins(layers: list[nn.Module]) -> bool:
        """Whether `concat` takes `layers`: IQ4_NL's code book joins only its own kind (other
        mixes become int8 blocks, `Q8Linear.concat`)."""
        nl = [isinstance(p, W6Linear) and p.zero_point == cpu_w6.NL for p in layers]
        return all(nl) or not any(nl)

    def dequantize(self) -> torch.Tensor:
        """The weight `[N, K]` in float32."""
        return cpu_w6.dequantize(self.packed, self.high, self.sb, self.zero_point)

    @classmethod
    def concat(cls, layers: list[nn.Module]) -> W6Linear:
        """One layer computing the outputs of `layers` (6-bit, or 4-bit on the own kernel)
        side by side, at the smallest group size among them: symmetric where all are, with one
        zero point; with top bits where any part has them (0 for the others)."""
        if not cls.joins(layers):
            raise ValueError("IQ4_NL layers join only each other")
        parts = [p if isinstance(p, W6Linear) else cls.from_quant_linear(p) for p in layers]
        if len({p.in_features for p in parts}) != 1 or len({p.bias is None for p in parts}) != 1:
            raise ValueError("layers differ in input size or bias")
        gs = min(p.group_size for p in parts)
        six = any(p.high is not None for p in parts)
        if any(p.group_size % gs for p in parts) or gs % (8 if six else 4):
            raise ValueError("group sizes do not divide each other")
        points = {p.zero_point for p in parts}
        zp = points.pop() if len(points) == 1 else 0

        def sb_of(p: W6Linear) -> torch.Tensor:
            if zp == cpu_w6.KQ:
                return p.sb
            sb = p.sb
            if p.zero_point and not zp:  # the scales and offsets written out, in float16
                sb = torch.stack(cpu_w6.tile_scales(p.sb, p.zero_point), dim=2).half()
            return sb.repeat_interleave(p.group_size // gs, dim=1)

        def high_of(p: W6Linear) -> torch.Tensor:
            t, chunks, _ = p.packed.shape
            return p.high if p.high is not None else torch.zeros(t, chunks // 2, 2 * cpu_w4.TILE,
                                                                 dtype=torch.uint8)

        out = cls(torch.cat([p.packed for p in parts]),
                  torch.cat([high_of(p) for p in parts]) if six else None,
                  torch.cat([sb_of(p) for p in parts]), zp)
        if parts[0].bias is not None:
            out.bias = torch.cat([p.bias for p in parts])  # type: ignore[misc]
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = cpu_w6.matmul(x.reshape(-1, self.in_features), self.packed, self.high, self.sb,
                          self.zero_point)
        if self.bias is not None:
            y += self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{'6' if self.high is not None else '4'}-bit, group {self.group_size}"
                + (", IQ4_NL code book" if self.zero_point == cpu_w6.NL
                   else f", zero point {self.zero_point}" if self.zero_point else ""))


class W6Embedding(TileEmbedding):
    """Rows of a 6-bit matrix (a `W6Linear`'s bytes) as float embeddings of `dtype`."""

    kind = "6-bit"

    def float_rows(self, tile: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        t, n = self.table, tile.numel()
        byte = (4 * (col % 8))[:, None] + torch.arange(4)  # [n, 4]: the bytes of column col
        half = (col // 8)[:, None, None]
        q = (t.packed[tile[:, None, None], torch.arange(t.packed.shape[1])[None, :, None],
                      byte[:, None, :]] >> (4 * half).to(torch.uint8)) & 15  # [n, K/4, 4]
        q = q.reshape(n, -1)
        if t.high is not None:
            h = t.high[tile[:, None, None], torch.arange(t.high.shape[1])[None, :, None],
                       byte[:, None, :]]  # [n, K/8, 4]
            shifts = (2 * half[..., None] + torch.tensor([0, 4]).view(1, 1, 2, 1)).to(torch.uint8)
            q = q | (((h[:, :, None, :] >> shifts) & 3).reshape(n, -1) << 4)  # [n, K/8, 2, 4]
        s, o = (v[torch.arange(n), :, col] for v in cpu_w6.tile_scales(t.sb[tile], t.zero_point))
        q = cpu_w6.values_of(q, t.zero_point)
        return q.float() * s.repeat_interleave(t.group_size, dim=1) + o.repeat_interleave(
            t.group_size, dim=1)
