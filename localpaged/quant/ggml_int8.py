"""GGUF block types as int8 codes with a scale (and offset) per block: the form the CPU's
8-bit kernel multiplies (`cpu_w4.matmul_q8`), for the types without a 4-bit kernel of their
own. Every value is `code * scale + offset`, the same number the type's own formula gives
(`ggml_types` holds the layouts); a few bits more per weight than the file, far fewer than a
float32 copy.

| type | codes | block | scale | offset |
|---|---|---|---|---|
| Q8_0 | q | 32 | d | - |
| Q5_0 | q - 16 | 32 | d | - |
| Q5_1 | q | 32 | d | m |
| IQ4_NL | KVALUES[q] | 32 | d | - |
| Q2_K | q | 16 | d * sc | -dmin * m |
| Q3_K | q - 4 (third bit unset) | 16 | d * (sc - 32) | - |
| Q5_K | q | 32 | d * sc | -dmin * m |
| Q6_K | q - 32 | 16 | d * sc | - |
| IQ4_XS | KVALUES[q] | 32 | d * (ls - 32) | - |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from localpaged.quant import ggml_types as gt

Parts = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # codes, scales, offsets per block


def _q8_0(b: np.ndarray) -> Parts:
    return b[:, 2:34].view(np.int8), gt.f16_field(b, 0), None


def _q5_0(b: np.ndarray) -> Parts:
    q = gt.nibbles(b[:, 6:22]) | (gt._bits32(b[:, 2:6]) << 4)
    return q.astype(np.int8) - 16, gt.f16_field(b, 0), None


def _q5_1(b: np.ndarray) -> Parts:
    q = gt.nibbles(b[:, 8:24]) | (gt._bits32(b[:, 4:8]) << 4)
    return q.astype(np.int8), gt.f16_field(b, 0), gt.f16_field(b, 2)


def _iq4_nl(b: np.ndarray) -> Parts:
    return gt.KVALUES_IQ4NL[gt.nibbles(b[:, 2:18])].astype(np.int8), gt.f16_field(b, 0), None


def _q2_k(b: np.ndarray) -> Parts:
    scales = b[:, 0:16]
    q = gt._crumbs(b[:, 16:80].reshape(-1, 2, 32)).reshape(-1, 256).astype(np.int8)
    d, dmin = gt.f16_field(b, 80), gt.f16_field(b, 82)
    return q, d * (scales & 0xF), -(dmin * (scales >> 4))


def _q3_k(b: np.ndarray) -> Parts:
    q = gt._crumbs(b[:, 32:96].reshape(-1, 2, 32)).astype(np.int8)
    hbit = (b[:, None, 0:32] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    q = q - 4 * (1 - hbit.reshape(-1, 2, 4, 32).astype(np.int8))
    return q.reshape(-1, 256), gt.f16_field(b, 108) * gt._q3_k_scales(b[:, 96:108]), None


def _q5_k(b: np.ndarray) -> Parts:
    hbit = (b[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    q = gt.k4_codes(b[:, 48:176]) | (hbit << 4)
    scales, mins = gt.k4_scales_mins(b[:, 4:16])
    return (q.reshape(-1, 256).astype(np.int8), gt.f16_field(b, 0) * scales,
            -(gt.f16_field(b, 2) * mins))


def _q6_k(b: np.ndarray) -> Parts:
    ql = b[:, 0:128].reshape(-1, 2, 2, 32)
    low = np.stack((ql & 0xF, ql >> 4), axis=2).reshape(-1, 2, 4, 32)
    high = gt._crumbs(b[:, 128:192].reshape(-1, 2, 32))
    q = (low | (high << 4)).astype(np.int8) - 32
    return q.reshape(-1, 256), gt.f16_field(b, 208) * b[:, 192:208].view(np.int8), None


def _iq4_xs(b: np.ndarray) -> Parts:
    scales_h = np.ascontiguousarray(b[:, 2:4]).view("<u2")
    low = gt.nibbles(b[:, 4:8]).reshape(-1, 2, 4).transpose(0, 2, 1).reshape(-1, 8)
    high = (scales_h >> np.arange(0, 16, 2, dtype=np.uint16)) & 3
    ls = (low | (high << 4)).astype(np.int16) - 32
    q = gt.KVALUES_IQ4NL[gt.nibbles(b[:, 8:136].reshape(-1, 8, 16))].astype(np.int8)
    return q.reshape(-1, 256), gt.f16_field(b, 0) * ls, None


# type -> (values per scale, block parts)
INT8_TYPES: dict[str, tuple[int, Callable[[np.ndarray], Parts]]] = {
    "Q8_0": (32, _q8_0),
    "Q5_0": (32, _q5_0),
    "Q5_1": (32, _q5_1),
    "IQ4_NL": (32, _iq4_nl),
    "Q2_K": (16, _q2_k),
    "Q3_K": (16, _q3_k),
    "Q5_K": (32, _q5_k),
    "Q6_K": (16, _q6_k),
    "IQ4_XS": (32, _iq4_xs),
}


@dataclass
class Int8Blocks:
    """A matrix `[N, K]` as int8 `codes`, float32 (Q8_0: float16) `scales` and `offsets` (or None)
    `[N, K/block]`: `W = codes * scale + offset` per block of `block` values of a row."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    block: int
    type_name: str = ""

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:
        """The matrix in float32."""
        w = self.codes.float() * self.scales.repeat_interleave(self.block, dim=1)
        return w if self.offsets is None else w + self.offsets.repeat_interleave(self.block, dim=1)

    @classmethod
    def q8_0_of(cls, weight: torch.Tensor, block: int = 32, chunk_rows: int = 4096) -> Int8Blocks:
        """A float matrix `[N, K]` quantized as GGUF's Q8_0 does: per block of `block` values,
        scale = max|w| / 127 (kept in float16), codes = w / scale rounded. A few thousand rows
        at a time, so a large table needs no float32 copy of itself."""
        n, k = weight.shape
        if k % block:
            raise ValueError(f"Q8_0 blocks need K % {block} == 0 (got {n} x {k})")
        codes = torch.empty(n, k, dtype=torch.int8)
        scales = torch.empty(n, k // block, dtype=torch.float16)
        for start in range(0, n, chunk_rows):
            w = weight[start:start + chunk_rows].float().reshape(-1, k // block, block)
            s = (w.abs().amax(dim=2) / 127).half()
            safe = torch.where(s > 0, s.float(), torch.ones_like(s, dtype=torch.float32))
            q = torch.round(w / safe[..., None]).clamp_(-127, 127)
            codes[start:start + chunk_rows] = q.reshape(-1, k).to(torch.int8)
            scales[start:start + chunk_rows] = s
        return cls(codes, scales, None, block, "Q8_0")

    def permute_rows(self, fn: Callable[[np.ndarray], np.ndarray]) -> Int8Blocks:
        """The same blocks with the rows reordered by `fn` (applied to each part)."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else torch.from_numpy(np.ascontiguousarray(fn(t.numpy())))

        return Int8Blocks(move(self.codes), move(self.scales), move(self.offsets),  # type: ignore[arg-type]
                          self.block, self.type_name)


def int8_blocks(type_name: str, data: np.ndarray, n: int, k: int) -> Int8Blocks:
    """A GGUF tensor of `type_name` with `n` rows of `k` values as `Int8Blocks`."""
    if type_name not in INT8_TYPES:
        raise ValueError(f"{type_name} has no int8 form (it has: {', '.join(INT8_TYPES)})")
    block, fn = INT8_TYPES[type_name]
    blocks = gt.blocks_of(type_name, data, n * k)
    codes, scales, offsets = fn(blocks)
    return Int8Blocks(
        torch.from_numpy(np.ascontiguousarray(codes, dtype=np.int8).reshape(n, k)),
        torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32).reshape(n, k // block)),
        None if offsets is None else torch.from_numpy(
            np.ascontiguousarray(offsets, dtype=np.float32).reshape(n, k // block)),
        block, type_name)


_C_TYPES = ("Q8_0", "Q5_0", "Q6_K")  # the C packer's (kernels/cpu/gguf_pack.c)
_KEPT_TYPES = (*_C_TYPES, "Q5_1", "Q5_K", "IQ4_NL", "IQ4_XS")  # also w6_linear.py's layout's


class GgmlInt8Weight:
    """A GGUF matrix of a type a C packer reads (Q8_0, Q5_0, Q6_K for the 8-bit tiles; those
    and Q5_1, Q5_K, IQ4_NL, IQ4_XS for the 6-bit layout) kept as the file's blocks (a view of the mapping) and
    the order of its rows, until `kernel_tiles` packs it straight into the 8-bit kernel's tiles
    (the numbers of `int8_blocks`, without its `[N, K]` arrays) or `W6Linear.from_gguf` into
    the 6-bit layout; `blocks()` gives the `Int8Blocks` for any other use."""

    def __init__(self, type_name: str, data: np.ndarray, n: int, k: int,
                 rows: np.ndarray | None = None) -> None:
        if type_name not in _KEPT_TYPES:
            raise ValueError(f"{type_name} is not packed in C (those that are: {', '.join(_KEPT_TYPES)})")
        gt.blocks_of(type_name, data, n * k)  # the byte count, checked now
        self.type_name, self.data, self.shape = type_name, data, (n, k)
        self.block = INT8_TYPES[type_name][0]
        self.rows = np.arange(n, dtype=np.int32) if rows is None else rows.astype(np.int32)

    @staticmethod
    def packable(type_name: str) -> bool:
        """Whether `type_name` has the 8-bit tiles' C packer and the library is here."""
        from localpaged.quant import cpu_w4

        return type_name in _C_TYPES and cpu_w4.available()

    def blocks(self) -> Int8Blocks:
        b = int8_blocks(self.type_name, self.data, *self.shape)
        return b.permute_rows(lambda a: a[self.rows])

    def kernel_tiles(self) -> tuple[torch.Tensor, torch.Tensor, None]:
        """(`tiles`, `tile_scales`, no offsets) as `cpu_w4.pack_q8` of `blocks()` gives them,
        the scales float16 for Q8_0 (its own d, exact: the file's 8.5 bits a weight, not 9)."""
        from localpaged.quant import cpu_w4

        n, k = self.shape
        half = self.type_name == "Q8_0"
        tiles = torch.empty(n // cpu_w4.TILE, k // 2, 2, cpu_w4.TILE, dtype=torch.int8)
        scales = torch.empty(n // cpu_w4.TILE, k // self.block, cpu_w4.TILE,
                             dtype=torch.float16 if half else torch.float32)
        cpu_w4.gguf_pack("gguf_q8_pack", self.type_name, self.data, self.rows, n, k,
                         tiles.data_ptr(), scales.data_ptr(), int(half))
        return tiles, scales, None
