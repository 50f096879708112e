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

import numpy as np

from localpaged.quant.ggml_types import (
    BLOCK_TYPES,
    blocks_of,
    f16_field,
    k4_codes,
    k4_scales_mins,
    nibbles,
)

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
