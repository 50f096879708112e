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


def cpu_w4_layout(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The CPU kernel's (`packed` uint8 `[N/16, K/2, 16]`, `sb` float16 `[N/16, G, 2, 16]`)
    straight from `int4_parts`' codes `[N, K]`, scales and zero-points `[N, G]`: the same
    bytes as `cpu_w4.pack` of the `Int4Weight` they make (offset `-zero * scale` in float32,
    then both rounded to float16 once), without packing the codes into int32 words first."""
    n, k = codes.shape
    pairs = codes.reshape(n // TILE, TILE, k // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).transpose(0, 2, 1)
    scales = scales.astype(np.float32, copy=False)
    offsets = -zeros.astype(np.float32, copy=False) * scales
    sb = np.stack((scales, offsets)).reshape(2, n // TILE, TILE, -1).transpose(1, 3, 0, 2)
    return np.ascontiguousarray(packed), np.ascontiguousarray(sb.astype(np.float16))


class GgmlInt4Weight:
    """A GGUF 4-bit matrix as `int4_parts` (rows `[N, ...]`), before any packing: becomes the
    CPU kernel's layout directly (`cpu_w4_layout`), or an `Int4Weight` (`to_int4`) for the
    other paths. Offers what `QuantLinear.load` asks of an `Int4Weight` to decide the path."""

    group_size = GROUP_SIZE
    perm = None

    def __init__(self, codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> None:
        self.q, self.s, self.z = codes, scales, zeros

    @property
    def out_features(self) -> int:
        return int(self.q.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.q.shape[1])

    @property
    def scales(self) -> torch.Tensor:
        """float32 `[G, N]`."""
        return torch.from_numpy(np.ascontiguousarray(self.s.T))

    @property
    def zeros(self) -> torch.Tensor:
        """float32 `[G, N]`."""
        return torch.from_numpy(np.ascontiguousarray(self.z.T))

    def codes(self) -> torch.Tensor:
        """int32 codes `[K, N]` (a transposed view of `[N, K]`; numpy converts them many
        times faster than torch's `.to(torch.int32)` here)."""
        return torch.from_numpy(self.q.astype(np.int32)).t()

    def cpu_w4_pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(`packed`, `sb`) for `cpu_w4.matmul`."""
        packed, sb = cpu_w4_layout(self.q, self.s, self.z)
        return torch.from_numpy(packed), torch.from_numpy(sb)

    def to_int4(self) -> Int4Weight:
        """The same weight as an `Int4Weight` (group size 32)."""
        from localpaged.quant.layout import from_codes

        return from_codes(torch.from_numpy(self.q.T.astype(np.int32)),
                          torch.from_numpy(np.ascontiguousarray(self.s.T)),
                          torch.from_numpy(np.ascontiguousarray(self.z.T)), GROUP_SIZE)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`W[N, K]`, as `Int4Weight.dequantize` computes it."""
        return self.to_int4().dequantize(dtype)
