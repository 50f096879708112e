"""The package's own CPU matmuls for quantized weights and bf16 or float32 activations
(`localpaged/kernels/cpu/quant_gemm.c`): a weight tile is unpacked once for all rows of x, so
a decode step of several requests reads the weight about once, where torch's int4 op unpacks
it again every 4 rows.

* 4-bit: `packed` uint8 `[N/16, K/2, 16]` (two codes of one column per byte, low nibble
  first) and `sb` float16 `[N/16, G, 2, 16]` (scale, then offset: `W = q * s + b`; float16
  as the files' own scales, so GGUF and AWQ/GPTQ weights are kept as they are).
* 4-bit, quads layout (float32 layers on builds with int8 dot products): `packed` uint8
  `[N/16, K/4, 32]`, chunk c of a tile holding K rows 4c..4c+3 of its 16 columns (byte
  4j + i: row 4c+i of column j in the low nibble, of column 8+j in the high one), `sb` as
  above: the same bytes reordered so that the int8 kernel unpacks with one AND and one shift
  (`is_quads` tells the layouts apart by shape).
* 8-bit per output channel (the lm_head): codes int8 `[N/16, K/2, 2, 16]`, scales float32 `[N]`.
* 8-bit per block of 32 (GGUF Q8_0): the same code tiles, float16 scales `[N/16, K/32, 16]`.

Float32 activations go through int8 dot products where the build has them
(`int8_activations()`: AVX2 and up, NEON on aarch64): each row of x is quantized to int8 per block (the 4-bit
weight's group, or Q8_0's 32), as llama.cpp does, `kernels/cpu/int8_dot.c`.
"""

from __future__ import annotations

import numpy as np
import torch

from localpaged.kernels import native
from localpaged.quant.layout import Int4Weight, native_library_for

TILE = 16
DTYPES = (torch.bfloat16, torch.float32)  # the activations the kernels take (and return)


def available() -> bool:
    """True when the kernel is wanted (`LOCALPAGED_CPU_KERNELS`), built and loaded here."""
    return native.available()


def supports(w: Int4Weight, dtype: torch.dtype) -> bool:
    """Whether `w` computed in `dtype` fits the kernel (bf16 or float32, N % 16 == 0, whole
    even groups)."""
    k, n, gs = w.in_features, w.out_features, w.group_size
    return dtype in DTYPES and n % TILE == 0 and gs % 2 == 0 and k % gs == 0


def int8_activations(isa: str | None = None) -> bool:
    """Whether float32 activations go through int8 dot products in the build for `isa`
    (default: this process's)."""
    lib = native.library(isa)
    return lib is not None and bool(lib.i8_dot_isa())


def holds_exactly(w: Int4Weight) -> bool:
    """Whether the kernel's float16 scales and offsets hold `w`'s, up to float32 rounding:
    GGUF Q4_0/Q4_1 do (float16 in the file); AWQ/GPTQ's offsets `-zero * scale` and Q4_K's
    scales need a few more bits, which only a float32 model would notice."""
    s = w.scales.float()
    b = -w.zeros.float() * s

    def close(t: torch.Tensor) -> bool:  # 2^-20: float32 arithmetic, far below float16's
        return bool(((t.half().float() - t).abs() <= t.abs() * 2**-20).all())

    return close(s) and close(b)


def pack(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(`packed`, `sb`) for the kernel from `w` (rows in stored order: an act-order layer's
    input must be permuted by `w.perm` before the matmul)."""
    k, n = w.in_features, w.out_features
    lib = native_library_for(w.qweight)
    if lib is not None:  # each byte of the internal words is a pair of rows already
        src = w.qweight.contiguous()
        packed = torch.empty(n // TILE, k // 2, TILE, dtype=torch.uint8)
        lib.w4_internal_to_pairs(src.data_ptr(), k, n, packed.data_ptr(), torch.get_num_threads())
    else:
        pairs = w.codes().to(torch.uint8).reshape(k // 2, 2, n // TILE, TILE)
        packed = (pairs[:, 0] | (pairs[:, 1] << 4)).permute(1, 0, 2).contiguous()
    s = w.scales.float()
    sb = torch.stack((s, -w.zeros.float() * s), dim=1)  # [G, 2, N]
    sb = sb.reshape(sb.shape[0], 2, n // TILE, TILE).permute(2, 0, 1, 3)
    return packed, sb.to(torch.float16).contiguous()


def is_quads(packed: torch.Tensor) -> bool:
    """Whether `packed` is in the quads layout (else the pairs one)."""
    return packed.shape[2] == 2 * TILE


def fits_quads(packed: torch.Tensor, sb: torch.Tensor) -> bool:
    """Whether the pairs-layout weight `(packed, sb)` can take the quads layout (K and the
    group size multiples of 4)."""
    k = packed.shape[1] * 2
    return k % 4 == 0 and (k // sb.shape[1]) % 4 == 0


def quads_wanted(dtype: torch.dtype = torch.float32, isa: str | None = None) -> bool:
    """Whether layers computing in `dtype` take the quads layout in the build for `isa`
    (default: this process's): the build has int8 activations and vector loops for that
    layout (AVX2 and up; NEON has them for the pairs layout only); for bf16, the builds with
    AVX512-BF16, whose bf16 products go through int8 activations (and on AMX, those of many
    rows through AMX tiles unpacked from the same layout)."""
    lib = native.library(isa)
    if lib is None or not lib.i8_dot_isa() or not lib.w4q_vector():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and bool(lib.w4_bf16_quads()))


def to_quads(packed: torch.Tensor) -> torch.Tensor:
    """The quads layout of pairs-layout `packed` (the same bytes per tile, reordered), in C
    where the library is here."""
    tiles, pairs, _ = packed.shape
    lib = native.library()
    if lib is not None:
        out = torch.empty(tiles, pairs // 2, 2 * TILE, dtype=torch.uint8)
        lib.w4_pairs_to_quads(packed.contiguous().data_ptr(), out.data_ptr(), tiles, pairs * 2,
                              torch.get_num_threads())
        return out
    return quads_in_torch(packed)


def quads_in_torch(packed: torch.Tensor) -> torch.Tensor:
    """`to_quads` in torch ops (without the library; the tests' reference for the C one)."""
    tiles, pairs, _ = packed.shape
    q = torch.stack((packed & 15, packed >> 4), dim=2).reshape(tiles, pairs // 2, 4, TILE)
    quads = q[..., :8] | (q[..., 8:] << 4)  # [T, chunk, i, j]
    return quads.transpose(2, 3).reshape(tiles, pairs // 2, 2 * TILE).contiguous()


def to_pairs(packed: torch.Tensor) -> torch.Tensor:
    """The pairs layout of `packed` (either layout)."""
    if not is_quads(packed):
        return packed
    tiles, chunks, _ = packed.shape
    b = packed.reshape(tiles, chunks, 8, 4).transpose(2, 3)  # [T, chunk, i, j]
    q = torch.cat((b & 15, b >> 4), dim=3).reshape(tiles, chunks * 2, 2, TILE)  # [T, p, 2, col]
    return (q[:, :, 0] | (q[:, :, 1] << 4)).contiguous()


def checked_ids(ids: torch.Tensor, count: int) -> torch.Tensor:
    """`ids` flattened, after an IndexError for any outside [0, `count`): for the embeddings
    that gather rows out of the kernels' tiles."""
    flat = ids.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= count):
        raise IndexError(f"token id out of range [0, {count})")
    return flat


def gguf_pack(kernel: str, type_name: str, data: np.ndarray, rows: np.ndarray, n: int, k: int,
              *outputs: int) -> None:
    """Run the C packer `kernel` (kernels/cpu/gguf_pack.c) on a GGUF matrix `[n, k]` of
    `type_name` from its file bytes `data`, output row i from the file's row `rows[i]`
    (int32), into the kernel-layout tensors at `outputs` (pointers, then the packer's flags)."""
    from localpaged.model.ggml_type_ids import GGMLType

    raw = np.ascontiguousarray(data)
    if getattr(native.library(), kernel)(raw.ctypes.data, GGMLType[type_name].value,
                                         rows.ctypes.data, n, k, *outputs,
                                         torch.get_num_threads()):
        raise ValueError(f"{type_name} [{n}, {k}] does not fit the kernel's tiles")


def dequantize(packed: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """The weight `[N, K]` in float32 (stored input order) from the kernel's layout (either)."""
    packed = to_pairs(packed)
    tiles, pairs, _ = packed.shape
    groups = sb.shape[1]
    q = torch.stack((packed & 15, packed >> 4), dim=2).reshape(tiles, groups, -1, TILE).float()
    s, b = sb.float().unbind(dim=2)  # [T, G, 16] each
    w = q * s[:, :, None] + b[:, :, None]  # [T, G, gs, 16]
    return w.reshape(tiles, pairs * 2, TILE).permute(0, 2, 1).reshape(tiles * TILE, pairs * 2)


def _gemm(kind: str, x: torch.Tensor, packed: torch.Tensor, params: torch.Tensor,
          extra: tuple[int, ...], isa: str | None, plain: bool | None = None) -> torch.Tensor:
    """Call `<kind>_gemm_<bf16|f32>(x, packed, params, y, M, K, N, *extra, threads[, plain])`:
    float32 `x` in float32, anything else in bf16; `y` comes in the same dtype."""
    lib = native.library(isa)
    if lib is None:
        raise RuntimeError(f"the CPU {kind} kernel is not available on this machine")
    f32 = x.dtype == torch.float32
    x = (x if f32 else x.to(torch.bfloat16)).contiguous()
    m, k = x.shape
    if packed.shape[1] * 2 != k:
        raise ValueError(f"x has {k} columns, the weight {packed.shape[1] * 2}")
    n = packed.shape[0] * TILE
    y = torch.empty(m, n, dtype=x.dtype)
    run = getattr(lib, f"{kind}_gemm_{'f32' if f32 else 'bf16'}")
    tail = () if plain is None else (int(plain),)
    if m and run(x.data_ptr(), packed.data_ptr(), params.data_ptr(), y.data_ptr(), m, k, n,
                 *extra, torch.get_num_threads(), *tail):
        raise MemoryError(f"the CPU {kind} kernel could not allocate its scratch memory")
    return y


def matmul(x: torch.Tensor, packed: torch.Tensor, sb: torch.Tensor,
           isa: str | None = None) -> torch.Tensor:
    """`x @ W.T` for bf16 or float32 `x` `[M, K]` (the quads layout: float32, and bf16 where
    `quads_wanted(torch.bfloat16)`);
    `isa` picks a CPU variant (default: this process's)."""
    if is_quads(packed):
        if x.dtype == torch.float32:
            return matmul_int8_activations(x, packed, sb, isa)
        if x.dtype != torch.bfloat16 or not quads_wanted(torch.bfloat16, isa):
            raise ValueError("the quads layout takes float32 activations (bf16 on builds "
                             "with AVX512-BF16)")
        pairs_view, group_size = _pairs_view(packed, sb)
        return _gemm("w4q", x, pairs_view, sb, (group_size,), isa)
    group_size = packed.shape[1] * 2 // sb.shape[1]
    return _gemm("w4", x, packed, sb, (group_size,), isa)


def pack_w8(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes `[N, K]` (N % 16 == 0, K even) in the kernel's tiles `[N/16, K/2, 2, 16]`."""
    n, k = codes.shape
    return codes.reshape(n // TILE, TILE, k // 2, 2).permute(0, 2, 3, 1).contiguous()


def matmul_w8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
              isa: str | None = None) -> torch.Tensor:
    """`(x @ codes.T) * scales` for bf16 or float32 `x` `[M, K]` and float32 `scales` `[N]`."""
    return _gemm("w8", x, packed, scales, (), isa)


Q8_BLOCK = 32  # GGUF Q8_0's block


def pack_q8(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(`tiles`, `tile_scales`, `tile_offsets`) for `matmul_q8` from int8 `codes` `[N, K]`
    and per-block `scales` (and `offsets`, or None) `[N, K/block]`: `W = codes * scale +
    offset` per block (GGUF Q8_0: block 32, no offset). N % 16 == 0, an even block. float16
    scales stay float16 (Q8_0's own: the kernel widens them a tile at a time), others float32."""
    n, k = codes.shape
    blocks = scales.shape[1]
    block = k // blocks if blocks else 0
    if n % TILE or not block or block % 2 or block * blocks != k or scales.shape[0] != n:
        raise ValueError(f"8-bit blocks need N % 16 == 0 and whole even blocks "
                         f"(got {n} x {k}, {blocks} blocks)")

    half = scales.dtype == torch.float16
    return (pack_w8(codes), tile_blocks(scales, torch.float16 if half else torch.float32),
            None if offsets is None else tile_blocks(offsets))


def tile_blocks(per_block: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-block values `[N, K/block]` (scales or offsets) in `pack_q8`'s layout
    `[N/16, K/block, 16]`."""
    n, blocks = per_block.shape
    return per_block.to(dtype).reshape(n // TILE, TILE, blocks).transpose(1, 2).contiguous()


def dequantize_q8(tiles: torch.Tensor, tile_scales: torch.Tensor,
                  tile_offsets: torch.Tensor | None = None) -> torch.Tensor:
    """The weight `[N, K]` in float32 from `pack_q8`'s layout."""
    t, pairs, _, _ = tiles.shape
    codes = tiles.permute(0, 3, 1, 2).reshape(t * TILE, pairs * 2).float()
    block = pairs * 2 // tile_scales.shape[1]

    def per_value(v: torch.Tensor) -> torch.Tensor:
        return v.transpose(1, 2).reshape(t * TILE, -1).repeat_interleave(block, dim=1)

    w = codes * per_value(tile_scales.float())
    return w if tile_offsets is None else w + per_value(tile_offsets)


def matmul_q8(x: torch.Tensor, tiles: torch.Tensor, tile_scales: torch.Tensor,
              tile_offsets: torch.Tensor | None = None, isa: str | None = None,
              plain: bool = False) -> torch.Tensor:
    """`x @ W.T` for float32 `x` `[M, K]` and 8-bit blocks (`pack_q8`), through int8
    activations per block; `plain` takes the plain-C loops (the tests' reference)."""
    lib = native.library(isa)
    if lib is None:
        raise RuntimeError("the CPU q8 kernel is not available on this machine")
    x = x.float().contiguous()
    m, k = x.shape
    if tiles.shape[1] * 2 != k:
        raise ValueError(f"x has {k} columns, the weight {tiles.shape[1] * 2}")
    n, block = tiles.shape[0] * TILE, k // tile_scales.shape[1]
    y = torch.empty(m, n, dtype=torch.float32)
    offsets = tile_offsets.data_ptr() if tile_offsets is not None else None
    half = int(tile_scales.dtype == torch.float16)
    if m and lib.q8_gemm_f32(x.data_ptr(), tiles.data_ptr(), tile_scales.data_ptr(), half,
                             offsets, y.data_ptr(), m, k, n, block, torch.get_num_threads(),
                             int(plain)):
        raise MemoryError("the CPU q8 kernel could not allocate its scratch memory")
    return y


def matmul_int8_activations(x: torch.Tensor, packed: torch.Tensor, sb: torch.Tensor,
                            isa: str | None = None, plain: bool = False) -> torch.Tensor:
    """`x @ W.T` for float32 `x` through int8 activations per group on any build (`plain`:
    the plain-C loops), for either 4-bit layout; what `matmul` does for float32 where
    `int8_activations()`."""
    quads = is_quads(packed)
    view, group_size = _pairs_view(packed, sb)
    return _gemm("w4q" if quads else "w4_i8", x.float(), view, sb, (group_size,), isa,
                 plain=plain)


def _pairs_view(packed: torch.Tensor, sb: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`packed` (either layout) in the pairs layout's shape, which `_gemm` reads K from (the
    same bytes), and the group size."""
    k = packed.shape[1] * (4 if is_quads(packed) else 2)
    return packed.view(packed.shape[0], k // 2, TILE), k // sb.shape[1]


def quantize_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes as float `[M, K]`, scales `[M, K/block]`) of float32 `x`, rounded as the
    kernels do: `x * (127 / max|x|)` to the nearest integer, ties to even."""
    m, k = x.shape
    xb = x.float().reshape(m, k // block, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(xb * inv).reshape(m, k), (amax / 127.0).squeeze(-1)
