"""The CPU kernel's 6-bit layout (kernels/cpu/int8_dot.c): GGUF Q6_K, Q5_0/1 and Q5_K
matrices in their own codes (0..63) instead of int8 blocks, 7-8 bits a weight where int8
blocks take 9-10. The low nibbles are the 4-bit quads layout (`cpu_w4.is_quads`), the top two
bits a plane beside it, and a float16 scale and offset per group, as 4-bit weights have:

    packed uint8 [N/16, K/4, 32]   nibbles: byte 4j + i of chunk c = q[4c+i][j] | q[4c+i][j+8] << 4
    high   uint8 [N/16, K/8, 32]   top bits of chunks 2p, 2p+1: byte 4j + i of pair p =
                                   t[8p+i][j] | t[8p+i][j+8] << 2 | t[8p+4+i][j] << 4 | t[8p+4+i][j+8] << 6
    sb     float16 [N/16, K/gs, 2, 16]   scale, offset per group: W = q * scale + offset
           or [N/16, K/gs, 1, 16]          scales of symmetric groups (a zero point zp:
                                           Q4_0's 8, Q5_0's 16, Q6_K's 32): W = (q - zp) * scale
           or [N/16, K/256, 160]           super-block scales (zero point KQ, Q4_K's and
                                           Q5_K's own): see `pack_kq`
    (`high` is None for 4-bit codes: the quads layout, for Q4_0, Q4_K and IQ4_NL.)

IQ4_NL (zero point NL) keeps its 4-bit codes and scales alone: code q stands for the byte
`NL_VALUES[q]` (ggml's kvalues_iq4nl + 128), W = (NL_VALUES[q] - 128) * scale; the kernels
look the bytes up (`vpshufb`).

The products go through int8 activations (as llama.cpp's do) on every x86 build from AVX2
on and on NEON (`available`); elsewhere these types stay int8 blocks. The activations take a
scale per group, or per super-block of 256 values for super-block scales (`activation_block`).
"""

from __future__ import annotations

import torch

from localpaged.kernels import native
from localpaged.quant.cpu_w4 import TILE


def available(isa: str | None = None) -> bool:
    """Whether the build for `isa` (default: this process's) multiplies float32 activations
    as int8 and has the layout's vector loops (x86 from AVX2 on, and NEON)."""
    lib = native.library(isa)
    return lib is not None and bool(lib.i8_dot_isa()) and bool(lib.w6_vector())


def fits(n: int, k: int, group_size: int) -> bool:
    """Whether an `[n, k]` matrix of groups of `group_size` fits the layout."""
    return n % TILE == 0 and group_size % 8 == 0 and k % group_size == 0


def pack(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
         zero_point: int = 0, top_bits: bool = True,
         ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(`packed`, `high`, `sb`) from codes 0..63 `[N, K]` and per-group float `scales` and
    `offsets` `[N, K/gs]` (torch ops: the tests' reference for the C packer, and the route for
    weights not read from a file). With a `zero_point` the offsets are `-zero_point * scale`
    and `sb` holds the scales only (`offsets` None); without `top_bits` the codes are 0..15
    and `high` is None (the 4-bit quads layout); `NL` takes IQ4_NL's code book (4-bit)."""
    n, k = codes.shape
    groups = scales.shape[1]
    gs = k // max(groups, 1)
    if n % TILE or gs % (8 if top_bits else 4) or groups * gs != k:
        raise ValueError(f"the 6-bit layout needs N % 16 == 0 and groups of a multiple of 8 "
                         f"(got {n} x {k}, {groups} groups)")
    if int(codes.min()) < 0 or int(codes.max()) > (63 if top_bits else 15):
        raise ValueError(f"the codes are 0..{63 if top_bits else 15}")
    if (offsets is None) != (zero_point != 0):
        raise ValueError("give offsets, or a zero point")
    if zero_point == NL and top_bits:
        raise ValueError("IQ4_NL's code book takes 4-bit codes (top_bits=False)")
    q = codes.to(torch.uint8).reshape(n // TILE, TILE, k // 4, 4).permute(0, 2, 3, 1)  # [T,c,i,j]
    packed = ((q[..., :8] & 15) | ((q[..., 8:] & 15) << 4)).transpose(2, 3)  # [T, c, j, i]
    high = None
    if top_bits:
        top = q >> 4
        pair = (top[..., :8] | (top[..., 8:] << 2)).reshape(n // TILE, k // 8, 2, 4, 8)
        high = (pair[:, :, 0] | (pair[:, :, 1] << 4)).transpose(2, 3)  # [T, p, j, i]
        high = high.reshape(n // TILE, k // 8, 2 * TILE).contiguous()
    parts = (scales.float(),) if zero_point else (scales.float(), offsets.float())  # type: ignore[union-attr]
    sb = torch.stack(parts, dim=1)  # [N, 1 or 2, G]
    sb = sb.reshape(n // TILE, TILE, len(parts), groups).permute(0, 3, 2, 1)
    return (packed.reshape(n // TILE, k // 4, 2 * TILE).contiguous(), high,
            sb.to(torch.float16).contiguous())


def codes_of(packed: torch.Tensor, high: torch.Tensor | None) -> torch.Tensor:
    """The codes `[N, K]` (uint8, 0..63) back from `packed` and `high` (None: 0..15)."""
    tiles, chunks, _ = packed.shape
    b = packed.reshape(tiles, chunks, 8, 4).transpose(2, 3)  # [T, c, i, j]
    low = torch.cat((b & 15, b >> 4), dim=3)  # [T, c, i, 16]
    if high is not None:
        h = high.reshape(tiles, chunks // 2, 8, 4).transpose(2, 3)  # [T, p, i, j]
        shifts = torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1, 1)
        bits = (h[:, :, None] >> shifts) & 15  # [T, p, half, i, j]: t[j] | t[j+8] << 2
        low = low | (torch.cat((bits & 3, bits >> 2), dim=4).reshape(tiles, chunks, 4, TILE) << 4)
    return low.permute(0, 3, 1, 2).reshape(tiles * TILE, chunks * 4)


KQ = -1  # the zero point that marks super-block scales (GGUF Q4_K's and Q5_K's form, see pack_kq)
NL = -2  # the zero point that marks IQ4_NL's code book (see the top)
NL_VALUES = torch.tensor([1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241],
                         dtype=torch.uint8)  # kvalues_iq4nl + 128


def symmetric_zero_point(zero_point: int) -> int:
    """The zero point of scales kept alone (IQ4_NL's is 128), as `-zp * scale` offsets them."""
    return 128 if zero_point == NL else zero_point


def values_of(codes: torch.Tensor, zero_point: int) -> torch.Tensor:
    """The integers the kernels multiply for `codes` (IQ4_NL's code book, else the codes)."""
    return NL_VALUES[codes.long()] if zero_point == NL else codes
KQ_RECORD = 160  # uint16 per tile and 256 values of K: d [16], dmin [16], sc [8][16], m [8][16] (u8)


def activation_block(zero_point: int, group_size: int, k: int = 256,
                     top_bits: bool = False) -> int:
    """How many values of K share an int8 activation scale in the product of a matrix of this
    form (K = `k`): its groups, or 256 (as llama.cpp's Q8_K) for super-block scales, where the
    loops then sum a super-block's groups and apply the float scales once, and for the
    symmetric groups of Q6_K's form (6-bit codes, zero point 32, groups of 16) and Q4_0's
    (4-bit codes, zero point 8, groups of 32), K a multiple of 256, whose VNNI loops do so."""
    if zero_point == KQ:
        return 256
    q6_k = zero_point == 32 and top_bits and group_size == 16
    q4_0 = zero_point == 8 and not top_bits and group_size == 32
    return 256 if (q6_k or q4_0) and k % 256 == 0 else group_size


def group_size(packed: torch.Tensor, sb: torch.Tensor, zero_point: int = 0) -> int:
    """The layer's group size."""
    return 32 if zero_point == KQ else packed.shape[1] * 4 // sb.shape[1]


def pack_kq(codes: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor,
            mins: torch.Tensor, top_bits: bool = False,
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(`packed`, `high`, `sb`) with super-block scales from codes `[N, K]` (0..15, or 0..63
    with `top_bits`: Q5_K's 0..31), float16-valued `d` and `dmin` `[N, K/256]` and 6-bit `sc`
    and `mins` `[N, K/32]`: W = d * sc * q - dmin * m per group of 32 (the C packer's form of
    Q4_K and Q5_K; the tests' reference for it). `high` is None without `top_bits`."""
    n, k = codes.shape
    packed, high, _ = pack(codes, torch.ones(n, k // 32), None, zero_point=1, top_bits=top_bits)
    t, supers = n // TILE, k // 256

    def per_tile(v: torch.Tensor, per: int) -> torch.Tensor:  # [N, S*per] -> [T, S, per, 16]
        return v.reshape(t, TILE, supers, per).permute(0, 2, 3, 1)

    halves = torch.stack((d, dmin), dim=2).half().view(torch.uint8).reshape(n, supers, 4)
    head = per_tile(halves.reshape(n, -1), 4)  # [T, S, 4 bytes, 16]: d lo/hi, dmin lo/hi
    head = head.reshape(t, supers, 2, 2, TILE).permute(0, 1, 2, 4, 3).reshape(t, supers, 64)
    codes8 = torch.cat((per_tile(sc.to(torch.uint8), 8), per_tile(mins.to(torch.uint8), 8)),
                       dim=2).reshape(t, supers, 256)
    record = torch.cat((head, codes8), dim=2).contiguous()  # [T, S, 320 bytes]
    return packed, high, record.view(torch.int16)


def tile_scales(sb: torch.Tensor, zero_point: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (scales, offsets) `[tiles, K/gs, 16]` of `sb` (tiles of a layer, or some)."""
    if zero_point == KQ:
        t, supers, _ = sb.shape
        rec = sb.contiguous().view(torch.uint8).reshape(t, supers, 2 * KQ_RECORD)
        halves = rec[:, :, :64].contiguous().view(torch.float16).float().reshape(t, supers, 2, 1, TILE)
        codes = rec[:, :, 64:].float().reshape(t, supers, 2, 8, TILE)
        s = (halves[:, :, 0] * codes[:, :, 0]).reshape(t, supers * 8, TILE)
        o = -(halves[:, :, 1] * codes[:, :, 1]).reshape(t, supers * 8, TILE)
        return s, o
    parts = sb.float().unbind(dim=2)
    return parts[0], (-symmetric_zero_point(zero_point) * parts[0] if zero_point else parts[1])


def scales_offsets(sb: torch.Tensor, zero_point: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group float32 (scales, offsets) `[N, K/gs]` of `sb`."""
    n = sb.shape[0] * TILE
    s, o = tile_scales(sb, zero_point)
    return s.permute(0, 2, 1).reshape(n, -1), o.permute(0, 2, 1).reshape(n, -1)


def dequantize(packed: torch.Tensor, high: torch.Tensor | None, sb: torch.Tensor,
               zero_point: int = 0) -> torch.Tensor:
    """The weight `[N, K]` in float32."""
    gs = group_size(packed, sb, zero_point)
    s, o = (v.repeat_interleave(gs, dim=1) for v in scales_offsets(sb, zero_point))
    return values_of(codes_of(packed, high), zero_point).float() * s + o


def matmul(x: torch.Tensor, packed: torch.Tensor, high: torch.Tensor | None, sb: torch.Tensor,
           zero_point: int = 0, isa: str | None = None, plain: bool = False) -> torch.Tensor:
    """`x @ W.T` for float32 or bf16 `x` `[M, K]` (other dtypes through float32), in x's
    dtype, through int8 activations per group (per super-block: `activation_block`);
    `plain` takes the plain-C loops (float32)."""
    lib = native.library(isa)
    if lib is None:
        raise RuntimeError("the CPU 6-bit kernel is not available on this machine")
    bf16 = x.dtype == torch.bfloat16 and not plain
    xc = (x if bf16 else x.float()).contiguous()
    m, k = xc.shape
    if packed.shape[1] * 4 != k:
        raise ValueError(f"x has {k} columns, the weight {packed.shape[1] * 4}")
    n = packed.shape[0] * TILE
    y = torch.empty(m, n, dtype=xc.dtype)
    args = (xc.data_ptr(), packed.data_ptr(), None if high is None else high.data_ptr(),
            sb.data_ptr(), zero_point, y.data_ptr(), m, k, n, group_size(packed, sb, zero_point),
            torch.get_num_threads())
    rc = (lib.w6_gemm_bf16(*args) if bf16 else lib.w6_gemm_f32(*args, int(plain))) if m else 0
    if rc:
        raise MemoryError("the CPU 6-bit kernel could not allocate its scratch memory")
    return y if y.dtype == x.dtype else y.to(x.dtype)
