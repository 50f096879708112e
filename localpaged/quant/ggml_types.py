"""Dequantize GGML tensor types (the blocks of a GGUF file) to float32, vectorized in numpy.

Each quantized type stores a row as consecutive blocks of `block_size` values in `type_size`
bytes; all fields are little-endian, `f16` an IEEE half. The layouts (ggml's `block_*` structs
in ggml-common.h, and `dequantize_row_*` in ggml-quants.c), per block:

| type | values | bytes | fields, in order | value |
|---|---|---|---|---|
| Q4_0 | 32 | 18 | f16 d, u8 qs[16] | `d * (q - 8)` |
| Q4_1 | 32 | 20 | f16 d, f16 m, u8 qs[16] | `d * q + m` |
| Q5_0 | 32 | 22 | f16 d, u32 qh, u8 qs[16] | `d * (q - 16)` |
| Q5_1 | 32 | 24 | f16 d, f16 m, u32 qh, u8 qs[16] | `d * q + m` |
| Q8_0 | 32 | 34 | f16 d, i8 qs[32] | `d * q` |
| IQ4_NL | 32 | 18 | f16 d, u8 qs[16] | `d * KVALUES[q]` |
| Q2_K | 256 | 84 | u8 scales[16], u8 qs[64], f16 d, f16 dmin | `d * sc * q - dmin * m` per 16 |
| Q3_K | 256 | 110 | u8 hmask[32], u8 qs[64], u8 scales[12], f16 d | `d * (sc - 32) * (q - 4)` per 16 |
| Q4_K | 256 | 144 | f16 d, f16 dmin, u8 scales[12], u8 qs[128] | `d * sc * q - dmin * m` per 32 |
| Q5_K | 256 | 176 | f16 d, f16 dmin, u8 scales[12], u8 qh[32], u8 qs[128] | as Q4_K, 5-bit q |
| Q6_K | 256 | 210 | u8 ql[128], u8 qh[64], i8 scales[16], f16 d | `d * sc * (q - 32)` per 16 |
| IQ4_XS | 256 | 136 | f16 d, u16 scales_h, u8 scales_l[4], u8 qs[128] | `d * (ls - 32) * KVALUES[q]` per 32 |

In the 32-value types byte j of `qs` holds value j (low nibble) and value j + 16 (high nibble);
bit j of Q5's `qh` is the fifth bit of value j. The bit positions of the K-quants are in the
functions below. Float arithmetic follows ggml's reference C (float32 products in its order),
so the values equal the `gguf` package's `dequantize` bit for bit (tests/quant); llama.cpp's
own kernels may differ in the last bit where the compiler fuses a multiply-add.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# The non-uniform 4-bit code book of IQ4_NL and IQ4_XS (ggml's kvalues_iq4nl).
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                         dtype=np.float32)
_CHUNK_BLOCKS = 1 << 16  # blocks dequantized at a time (bounds the temporaries' memory)


def f16_field(blocks: np.ndarray, at: int) -> np.ndarray:
    """The f16 field at byte `at` of every block, as float32 `[nb, 1]`."""
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16).astype(np.float32)


def nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes `[..., n]` -> codes `[..., 2n]`: the low nibbles, then the high nibbles."""
    return np.concatenate((qs & 0xF, qs >> 4), axis=-1)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """Four bytes per block (a little-endian u32) -> its 32 bits `[nb, 32]`, bit j at j."""
    word = np.ascontiguousarray(qh).view("<u4")  # [nb, 1]
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _q4_0(b: np.ndarray) -> np.ndarray:
    return f16_field(b, 0) * (nibbles(b[:, 2:18]).astype(np.int8) - 8)


def _q4_1(b: np.ndarray) -> np.ndarray:
    return f16_field(b, 0) * nibbles(b[:, 4:20]) + f16_field(b, 2)


def _q5_0(b: np.ndarray) -> np.ndarray:
    q = nibbles(b[:, 6:22]) | (_bits32(b[:, 2:6]) << 4)
    return f16_field(b, 0) * (q.astype(np.int8) - 16)


def _q5_1(b: np.ndarray) -> np.ndarray:
    q = nibbles(b[:, 8:24]) | (_bits32(b[:, 4:8]) << 4)
    return f16_field(b, 0) * q + f16_field(b, 2)


def _q8_0(b: np.ndarray) -> np.ndarray:
    return f16_field(b, 0) * b[:, 2:34].view(np.int8)


def _iq4_nl(b: np.ndarray) -> np.ndarray:
    return f16_field(b, 0) * KVALUES_IQ4NL[nibbles(b[:, 2:18])]


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """K-quant 2-bit fields: `qs` `[nb, 2, 32]` (one 32-byte run per 128 values) -> codes
    `[nb, 2, 4, 32]`: value `128 n + 32 j + l` is bits `2j, 2j+1` of byte `l` of run n."""
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    return (qs[:, :, None, :] >> shifts) & 3


def _q2_k(b: np.ndarray) -> np.ndarray:
    scales = b[:, 0:16]  # one per 16 values: scale in the low nibble, min in the high one
    q = _crumbs(b[:, 16:80].reshape(-1, 2, 32)).reshape(-1, 16, 16)
    d, dmin = f16_field(b, 80)[:, :, None], f16_field(b, 82)[:, :, None]
    dl = d * (scales & 0xF)[:, :, None]
    ml = dmin * (scales >> 4)[:, :, None]
    return (dl * q - ml).reshape(-1, 256)


def _q3_k_scales(s: np.ndarray) -> np.ndarray:
    """Sixteen 6-bit scales from 12 bytes: scale i's low 4 bits are the low (i < 8) or high
    (i >= 8) nibble of byte i % 8, its high 2 bits are bits 2 (i // 4), +1 of byte 8 + i % 4."""
    low = np.concatenate((s[:, 0:8] & 0xF, s[:, 0:8] >> 4), axis=1)
    shifts = np.repeat(np.array([0, 2, 4, 6], dtype=np.uint8), 4)
    high = (np.tile(s[:, 8:12], 4) >> shifts) & 3
    return (low | (high << 4)).astype(np.int8) - 32


def _q3_k(b: np.ndarray) -> np.ndarray:
    q = _crumbs(b[:, 32:96].reshape(-1, 2, 32)).astype(np.int8)  # [nb, 2, 4, 32]
    # The third bit of value 128 n + 32 j + l is bit 4 n + j of hmask byte l; unset means -4.
    hbit = (b[:, None, 0:32] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [nb, 8, 32]
    q = q - 4 * (1 - hbit.reshape(-1, 2, 4, 32).astype(np.int8))
    dl = f16_field(b, 108) * _q3_k_scales(b[:, 96:108])  # [nb, 16]
    return (dl[:, :, None] * q.reshape(-1, 16, 16)).reshape(-1, 256)


def k4_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: eight 6-bit scales and eight 6-bit mins `[nb, 8]` each from 12 bytes.

    Sub-blocks 0..3 take the low 6 bits of bytes 0..3 (scales) and 4..7 (mins); sub-blocks
    4..7 take a nibble of bytes 8..11 (low: scale, high: min) plus the top 2 bits of bytes
    0..3 (scale) and 4..7 (min) as their bits 4, 5."""
    scales = np.concatenate((s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)), axis=1)
    mins = np.concatenate((s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)), axis=1)
    return scales, mins


def k4_codes(qs: np.ndarray) -> np.ndarray:
    """Q4_K codes `[nb, 8, 32]` (sub-block, value) from 128 bytes: each 32-byte run c holds
    sub-block 2c in its low nibbles and sub-block 2c + 1 in its high nibbles."""
    return nibbles(qs.reshape(-1, 4, 32)).reshape(-1, 8, 32)


def _k_affine(b: np.ndarray, q: np.ndarray) -> np.ndarray:
    """`d * sc * q - dmin * m` per 32-value sub-block of a Q4_K / Q5_K block."""
    scales, mins = k4_scales_mins(b[:, 4:16])
    d1 = f16_field(b, 0) * scales  # [nb, 8]
    m1 = f16_field(b, 2) * mins
    return (d1[:, :, None] * q - m1[:, :, None]).reshape(-1, 256)


def _q4_k(b: np.ndarray) -> np.ndarray:
    return _k_affine(b, k4_codes(b[:, 16:144]))


def _q5_k(b: np.ndarray) -> np.ndarray:
    # The fifth bit of value l of sub-block i is bit i of qh byte l.
    hbit = (b[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    return _k_affine(b, k4_codes(b[:, 48:176]) | (hbit << 4))


def _q6_k(b: np.ndarray) -> np.ndarray:
    # Per 128 values n: value 128 n + 32 k + l has its low 4 bits in ql byte 64 n + 32 (k % 2)
    # + l (low nibble for k < 2, high for k >= 2) and its top 2 bits at bits 2k of qh byte 32 n + l.
    ql = b[:, 0:128].reshape(-1, 2, 2, 32)  # [nb, n, k % 2, l]
    low = np.stack((ql & 0xF, ql >> 4), axis=2).reshape(-1, 2, 4, 32)
    high = _crumbs(b[:, 128:192].reshape(-1, 2, 32))
    q = (low | (high << 4)).astype(np.int8) - 32
    sc = b[:, 192:208].view(np.int8).astype(np.float32)  # one per 16 values
    dl = f16_field(b, 208) * sc
    return (dl[:, :, None] * q.reshape(-1, 16, 16)).reshape(-1, 256)


def _iq4_xs(b: np.ndarray) -> np.ndarray:
    # Sub-block i of 32: a 6-bit scale, low 4 bits from nibble i % 2 of scales_l[i // 2],
    # high 2 bits from bits 2i, 2i+1 of scales_h; its 16 bytes of qs as in IQ4_NL.
    scales_h = np.ascontiguousarray(b[:, 2:4]).view("<u2")  # [nb, 1]
    low = nibbles(b[:, 4:8]).reshape(-1, 2, 4).transpose(0, 2, 1).reshape(-1, 8)
    high = (scales_h >> np.arange(0, 16, 2, dtype=np.uint16)) & 3
    ls = (low | (high << 4)).astype(np.int16) - 32
    dl = f16_field(b, 0) * ls  # [nb, 8]
    q = KVALUES_IQ4NL[nibbles(b[:, 8:136].reshape(-1, 8, 16))]
    return (dl[:, :, None] * q).reshape(-1, 256)


# type name -> (values per block, bytes per block, block dequantizer)
BLOCK_TYPES: dict[str, tuple[int, int, Callable[[np.ndarray], np.ndarray]]] = {
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1),
    "Q8_0": (32, 34, _q8_0),
    "IQ4_NL": (32, 18, _iq4_nl),
    "Q2_K": (256, 84, _q2_k),
    "Q3_K": (256, 110, _q3_k),
    "Q4_K": (256, 144, _q4_k),
    "Q5_K": (256, 176, _q5_k),
    "Q6_K": (256, 210, _q6_k),
    "IQ4_XS": (256, 136, _iq4_xs),
}
FLOAT_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = FLOAT_TYPES + tuple(BLOCK_TYPES)


def blocks_of(type_name: str, data: np.ndarray, n_values: int) -> np.ndarray:
    """The bytes of a `type_name` tensor of `n_values` values as `[blocks, type_size]` uint8;
    ValueError if the sizes do not fit."""
    block, size, _ = BLOCK_TYPES[type_name]
    raw = np.asarray(data).reshape(-1).view(np.uint8)
    if n_values % block or raw.size != n_values // block * size:
        raise ValueError(f"{type_name}: {raw.size} bytes do not hold {n_values} values "
                         f"(blocks of {block} values in {size} bytes)")
    return raw.reshape(-1, size)


def dequantize(type_name: str, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of shape `shape` from a tensor's stored data (bytes or float array)."""
    n = int(np.prod(shape, dtype=np.int64))
    if type_name == "F32":
        return np.asarray(data).reshape(-1).view(np.float32).reshape(shape)
    if type_name == "F16":
        return np.asarray(data).reshape(-1).view(np.float16).astype(np.float32).reshape(shape)
    if type_name == "BF16":
        bits = np.asarray(data).reshape(-1).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    if type_name not in BLOCK_TYPES:
        raise ValueError(f"GGML type {type_name} is not supported "
                         f"(supported: {', '.join(SUPPORTED_TYPES)})")
    blocks = blocks_of(type_name, data, n)
    fn = BLOCK_TYPES[type_name][2]
    out = np.empty((blocks.shape[0], BLOCK_TYPES[type_name][0]), dtype=np.float32)
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        out[start:start + _CHUNK_BLOCKS] = fn(blocks[start:start + _CHUNK_BLOCKS])
    return out.reshape(shape)
