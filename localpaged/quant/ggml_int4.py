"""GGML 4-bit affine types as 4-bit codes + per-32-value scale and zero-point, the parts of the
internal `Int4Weight` layout (group size 32), with the same values as the file.

* Q4_0: `d * (q - 8)`: scale `d`, zero-point 8 (exact in any float dtype).
* Q4_1: `d * q + m`: scale `d`, zero-point `-m / d`.
* Q4_K: per 32-value sub-block `d * sc * q - dmin * m` (6-bit `sc`, `m`; see
  `ggml_types.k4_scales_mins`): scale `d * sc`, zero-point `dmin * m / (d * sc)`.

A block whose scale is 0 is constant (`m`, or `-dmin * m`): codes 0, zero-point -1 and the
constant as its scale. In float32, `(q - zero) * scale` equals the file's value to a few ulps
(the division in the zero-point), the dense path's values exactly.

Rounding added downstream, in 16-bit compute: `Int4Weight` keeps float32 scales/zeros, but a
`QuantLinear` casts them to its dtype. The CPU kernel (`cpu_w4.pack`) stores `W = q * s + b`
with `s` and `b = -zero * s` in bf16, computed from the float32 parts: each of the scale
`d * sc` (an f16 times a 6-bit integer: up to 17 significant bits) and the offset
`-dmin * m` is rounded once to bf16's 8 bits (relative error <= 2^-9), which is below the
bf16 rounding of the activations the same matmul adds. Triton (CUDA, fp16) keeps fp16
scales and zero-points (relative error <= 2^-12 each).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from localpaged.quant.ggml_types import (
    BLOCK_TYPES,
    blocks_of,
    f16_field,
    k4_codes,
    k4_scales_mins,
    nibbles,
)

if TYPE_CHECKING:
    from localpaged.quant.layout import Int4Weight

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
GROUP_SIZE = 32


def _flat_blocks(codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes, scales, zeros) for `scale * q + offset` groups, constant groups handled."""
    flat = scales == 0
    zeros = np.where(flat, -1.0, -offsets / np.where(flat, 1.0, scales)).astype(np.float32)
    scales = np.where(flat, offsets, scales).astype(np.float32)
    codes = np.where(flat[..., None], 0, codes).astype(np.uint8)
    return codes, scales, zeros


def int4_parts(type_name: str, data: np.ndarray, n: int, k: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A GGML Q4_0 / Q4_1 / Q4_K matrix `[n, k]` as (uint8 codes `[n, k]`, float32 scales
    `[n, k/32]`, float32 zero-points `[n, k/32]`): `W = (codes - zeros) * scales` per group."""
    if type_name not in INT4_TYPES:
        raise ValueError(f"GGML type {type_name} has no exact 4-bit form "
                         f"(those that do: {', '.join(INT4_TYPES)})")
    block = BLOCK_TYPES[type_name][0]
    if k % block:
        raise ValueError(f"{type_name}: rows of {k} values are not whole blocks of {block}")
    b = blocks_of(type_name, data, n * k)
    if type_name == "Q4_0":
        codes = nibbles(b[:, 2:18])[:, None, :]  # [nb, 1, 32]
        scales, zeros = f16_field(b, 0), np.full((b.shape[0], 1), 8.0, dtype=np.float32)
    elif type_name == "Q4_1":
        codes, scales, zeros = _flat_blocks(nibbles(b[:, 4:20])[:, None, :], f16_field(b, 0), f16_field(b, 2))
    else:
        sc, m = k4_scales_mins(b[:, 4:16])
        # The same float32 products as the dequantization: d * sc and dmin * m.
        codes, scales, zeros = _flat_blocks(k4_codes(b[:, 16:144]), f16_field(b, 0) * sc, -(f16_field(b, 2) * m))
    return codes.reshape(n, k), scales.reshape(n, k // GROUP_SIZE), zeros.reshape(n, k // GROUP_SIZE)


TILE = 16  # the CPU kernel's output-channel tile (`cpu_w4.TILE`)


def int4_pairs(type_name: str, data: np.ndarray, n: int, k: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`int4_parts` with the codes two to a byte along K: uint8 `[n, k/2]`, byte `p` of a row
    = code `2p` (low nibble) | code `2p + 1` (high nibble), the CPU kernel's pairing. Q4_0 and
    Q4_1 bytes are re-paired directly (their byte j holds codes j and j + 16)."""
    if type_name not in ("Q4_0", "Q4_1"):
        codes, scales, zeros = int4_parts(type_name, data, n, k)
        return codes[:, 0::2] | (codes[:, 1::2] << 4), scales, zeros
    if k % GROUP_SIZE:
        raise ValueError(f"{type_name}: rows of {k} values are not whole blocks of {GROUP_SIZE}")
    b = blocks_of(type_name, data, n * k)
    qs = b[:, 2:18] if type_name == "Q4_0" else b[:, 4:20]
    even, odd = qs[:, 0::2], qs[:, 1::2]
    pairs = np.concatenate(((even & 0xF) | ((odd & 0xF) << 4), (even >> 4) | (odd & 0xF0)), axis=1)
    if type_name == "Q4_0":
        scales, zeros = f16_field(b, 0), np.full((b.shape[0], 1), 8.0, dtype=np.float32)
    else:
        pairs3, scales, zeros = _flat_blocks(pairs[:, None, :], f16_field(b, 0), f16_field(b, 2))
        pairs = pairs3[:, 0]
    groups = k // GROUP_SIZE
    return pairs.reshape(n, k // 2), scales.reshape(n, groups), zeros.reshape(n, groups)


def cpu_w4_layout(pairs: np.ndarray, scales: np.ndarray, zeros: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The CPU kernel's (`packed` uint8 `[N/16, K/2, 16]`, `sb` float16 `[N/16, G, 2, 16]`)
    straight from `int4_pairs`' codes `[N, K/2]`, scales and zero-points `[N, G]`: the same
    bytes as `cpu_w4.pack` of the `Int4Weight` they make (offset `-zero * scale` in float32,
    then both rounded to float16 once), without packing the codes into int32 words first."""
    n, half = pairs.shape
    packed = pairs.reshape(n // TILE, TILE, half).transpose(0, 2, 1)
    scales = scales.astype(np.float32, copy=False)
    offsets = -zeros.astype(np.float32, copy=False) * scales
    sb = np.stack((scales, offsets)).reshape(2, n // TILE, TILE, -1).transpose(1, 3, 0, 2)
    return np.ascontiguousarray(packed), np.ascontiguousarray(sb.astype(np.float16))


class GgmlInt4Weight:
    """A GGUF 4-bit matrix as `int4_pairs` (rows `[N, ...]`), before any packing: becomes the
    CPU kernel's layout directly (`cpu_w4_pack`), or an `Int4Weight` (`to_int4`) for the
    other paths. Offers what `QuantLinear.load` asks of an `Int4Weight` to decide the path.

    `from_blocks` keeps a Q4_0 / Q4_1 / Q4_K matrix as the file's blocks (a view of the mapping) and
    the order of its rows: the C packer reads them straight into the kernel's layout, and the
    numpy parts are made only if another path asks for them."""

    group_size = GROUP_SIZE
    perm = None

    def __init__(self, pairs: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> None:
        self._parts: tuple[np.ndarray, np.ndarray, np.ndarray] | None = (pairs, scales, zeros)
        self._shape = (int(pairs.shape[0]), int(pairs.shape[1]) * 2)
        self._blocks: tuple[str, np.ndarray, np.ndarray] | None = None

    @classmethod
    def from_blocks(cls, type_name: str, data: np.ndarray, n: int, k: int,
                    rows: np.ndarray | None = None) -> GgmlInt4Weight:
        """A matrix `[n, k]` of `type_name` from its file bytes `data`; output row i is the
        file's row `rows[i]` (default: in order)."""
        if type_name not in INT4_TYPES:
            raise ValueError(f"GGML type {type_name} has no exact 4-bit form "
                             f"(those that do: {', '.join(INT4_TYPES)})")
        if k % BLOCK_TYPES[type_name][0]:
            raise ValueError(f"{type_name}: rows of {k} values are not whole blocks of "
                             f"{BLOCK_TYPES[type_name][0]}")
        blocks_of(type_name, data, n * k)  # the byte count, checked now
        self = cls.__new__(cls)
        self._parts, self._shape = None, (n, k)
        order = np.arange(n, dtype=np.int32) if rows is None else rows.astype(np.int32)
        self._blocks = (type_name, data, order)
        return self

    @property
    def type_name(self) -> str | None:
        """The file's GGML type (None for a weight given as parts)."""
        return None if self._blocks is None else self._blocks[0]

    def _numpy_parts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._parts is None:
            assert self._blocks is not None
            type_name, data, order = self._blocks
            pairs, s, z = int4_pairs(type_name, data, *self._shape)
            self._parts = (pairs[order], s[order], z[order])
        return self._parts

    @property
    def pairs(self) -> np.ndarray:
        return self._numpy_parts()[0]

    @property
    def s(self) -> np.ndarray:
        return self._numpy_parts()[1]

    @property
    def z(self) -> np.ndarray:
        return self._numpy_parts()[2]

    @property
    def out_features(self) -> int:
        return self._shape[0]

    @property
    def in_features(self) -> int:
        return self._shape[1]

    @property
    def scales(self) -> torch.Tensor:
        """float32 `[G, N]`."""
        return torch.from_numpy(np.ascontiguousarray(self.s.T))

    @property
    def zeros(self) -> torch.Tensor:
        """float32 `[G, N]`."""
        return torch.from_numpy(np.ascontiguousarray(self.z.T))

    def codes_nk(self) -> np.ndarray:
        """uint8 codes `[N, K]`."""
        out = np.empty((self.out_features, self.in_features), dtype=np.uint8)
        out[:, 0::2] = self.pairs & 0xF
        out[:, 1::2] = self.pairs >> 4
        return out

    def codes(self) -> torch.Tensor:
        """int32 codes `[K, N]` (a transposed view of `[N, K]`; numpy converts them many
        times faster than torch's `.to(torch.int32)` here)."""
        return torch.from_numpy(self.codes_nk().astype(np.int32)).t()

    def cpu_w4_pack(self, quads: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(`packed`, `sb`) for `cpu_w4.matmul`, `packed` in the quads layout if `quads`:
        in C from the file's blocks where the library is here (the same bytes), else numpy."""
        from localpaged.quant import cpu_w4

        n, k = self._shape
        if self._blocks is not None and cpu_w4.available():  # gguf_pack.c reads every INT4_TYPES
            type_name, data, order = self._blocks
            packed = torch.empty(n // TILE, k // (4 if quads else 2), TILE * (2 if quads else 1),
                                 dtype=torch.uint8)
            sb = torch.empty(n // TILE, k // GROUP_SIZE, 2, TILE, dtype=torch.float16)
            cpu_w4.gguf_pack("gguf_q4_pack", type_name, data, order, n, k, packed.data_ptr(),
                             sb.data_ptr(), int(quads))
            return packed, sb
        packed, sb = cpu_w4_layout(self.pairs, self.s, self.z)
        out = torch.from_numpy(packed)
        return (cpu_w4.to_quads(out) if quads else out), torch.from_numpy(sb)

    def to_int4(self) -> Int4Weight:
        """The same weight as an `Int4Weight` (group size 32)."""
        from localpaged.quant.layout import from_codes

        return from_codes(self.codes(), torch.from_numpy(np.ascontiguousarray(self.s.T)),
                          torch.from_numpy(np.ascontiguousarray(self.z.T)), GROUP_SIZE)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`W[N, K]`, the float32 numbers of `Int4Weight.dequantize`: `(q - zero) * scale`."""
        n, k = self.out_features, self.in_features
        q = self.codes_nk().reshape(n, k // GROUP_SIZE, GROUP_SIZE).astype(np.float32)
        w = (q - self.z[:, :, None]) * self.s[:, :, None]
        return torch.from_numpy(w.reshape(n, k)).to(dtype)
