"""The one internal packed-int4 layout every 4-bit format is converted to at load time.

`Int4Weight` holds a linear layer's weight `W[out, in]` (N = out, K = in) as

* `qweight`: int32 `[K/8, N]`, codes packed along K, nibble k of `qweight[r, n]` = code of
  input row `8r + k` (LSB first, no interleave; the GPTQ v1 order). One 32-bit load gives a
  kernel eight consecutive K rows of one output column, so a `[BLOCK_K/8, BLOCK_N]` tile is
  one coalesced read.
* `scales`, `zeros`: `[G, N]` floats, `W[n, k] = (q[k, n] - zeros[g, n]) * scales[g, n]` with
  `g = k // group_size`. Integer zero-points (GPTQ, AWQ, GGUF Q4_0) are exact in any float
  dtype; GGUF Q4_1's float offsets fit the same formula.
* `perm` (act-order): when not None, row i of `qweight` is original input channel `perm[i]`,
  rows sorted so that groups are contiguous; the matmul reads `x[:, perm]`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

NIBBLE_SHIFTS = tuple(range(0, 32, 4))


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) -> int32 with the same bits (two's complement)."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_nibbles(codes: torch.Tensor, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack 4-bit codes (values 0..15) eight to an int32 word along `dim` (size % 8 == 0).

    Nibble k of word j holds element `8j + order[k]` (order defaults to 0..7)."""
    if codes.shape[dim] % 8:
        raise ValueError(f"cannot pack {codes.shape[dim]} codes along dim {dim}: not a multiple of 8")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError("4-bit codes must lie in 0..15")
    c = codes.to(torch.int64).movedim(dim, -1)
    c = c.reshape(*c.shape[:-1], -1, 8)
    if order is not None:
        c = c[..., list(order)]
    shifts = torch.tensor(NIBBLE_SHIFTS, dtype=torch.int64, device=c.device)
    words = (c << shifts).sum(-1)
    return _to_int32(words).movedim(-1, dim).contiguous()


def unpack_nibbles(
    words: torch.Tensor, dim: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """Inverse of `pack_nibbles`: int32 words -> int32 codes 0..15, 8x longer along `dim`."""
    w = words.to(torch.int32).movedim(dim, -1)
    shifts = torch.tensor(NIBBLE_SHIFTS, dtype=torch.int32, device=w.device)
    c = (w.unsqueeze(-1) >> shifts) & 0xF  # [..., words, 8] in nibble order
    if order is not None:
        inverse = [0] * 8
        for k, col in enumerate(order):
            inverse[col] = k
        c = c[..., inverse]
    return c.reshape(*w.shape[:-1], -1).movedim(-1, dim).contiguous()


@dataclass
class Int4Weight:
    """A 4-bit weight in the internal layout (see the module docstring)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    perm: torch.Tensor | None = None

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[0]) * 8

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[1])

    def __post_init__(self) -> None:
        k, n = self.in_features, self.out_features
        groups = -(-k // self.group_size)
        for name, t in (("scales", self.scales), ("zeros", self.zeros)):
            if tuple(t.shape) != (groups, n):
                raise ValueError(f"{name}: expected shape {(groups, n)}, found {tuple(t.shape)}")
        if self.qweight.dtype != torch.int32:
            raise ValueError(f"qweight: expected int32, found {self.qweight.dtype}")
        if self.perm is not None and tuple(self.perm.shape) != (k,):
            raise ValueError(f"perm: expected shape {(k,)}, found {tuple(self.perm.shape)}")

    def codes(self) -> torch.Tensor:
        """int32 codes `[K, N]` in stored (possibly permuted) row order."""
        return unpack_nibbles(self.qweight, 0)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`W[out, in]` in the original input order, computed in float32 then cast."""
        q = self.codes().float()
        g = torch.arange(self.in_features, device=q.device) // self.group_size
        w = (q - self.zeros.float()[g]) * self.scales.float()[g]  # [K, N], stored order
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(0, self.perm.to(w.device), w)
        return w.t().contiguous().to(dtype)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Int4Weight:
        """Move to `device`; cast scales/zeros to `dtype` (codes stay int32)."""
        return Int4Weight(
            self.qweight.to(device),
            self.scales.to(device=device, dtype=dtype),
            self.zeros.to(device=device, dtype=dtype),
            self.group_size,
            None if self.perm is None else self.perm.to(device),
        )


def from_codes(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
) -> Int4Weight:
    """Build an `Int4Weight` from codes `[K, N]` (original input order), per-group
    `scales`/`zeros` `[G, N]` and an optional group index per input row (act-order).

    A non-trivial `g_idx` is turned into a row permutation sorting rows by group; it must
    then give every group `group_size` rows (the last may be shorter), as GPTQ's do."""
    return from_packed(pack_nibbles(codes, 0), scales, zeros, group_size, g_idx)


def from_packed(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
) -> Int4Weight:
    """`from_codes` for codes already packed in the internal layout (`qweight` int32
    `[K/8, N]`, original input order): GPTQ's own words, or AWQ's once transposed."""
    k = qweight.shape[0] * 8
    if group_size <= 0:
        group_size = k
    zeros = zeros.to(scales.dtype)
    trivial = torch.arange(k, device=qweight.device) // group_size
    if g_idx is None or torch.equal(g_idx.to(trivial), trivial):
        return Int4Weight(qweight, scales, zeros, group_size)
    perm = torch.sort(g_idx.to(torch.int64), stable=True).indices
    if not torch.equal(g_idx.to(torch.int64)[perm], trivial):
        raise ValueError(
            f"g_idx: every group must hold exactly group_size={group_size} input channels "
            "(the last group may hold fewer)"
        )
    return Int4Weight(gather_rows(qweight, perm), scales, zeros, group_size, perm)


def native_library_for(t: torch.Tensor) -> ctypes.CDLL | None:
    """The C library where it can take `t` (an int32 CPU tensor), else None."""
    from localpaged.kernels import native

    if t.device.type != "cpu" or t.dtype != torch.int32 or not native.available():
        return None
    return native.library()


def gather_rows(qweight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Internal-layout `qweight` with its input rows reordered: row i of the result is row
    `rows[i]` of `qweight` (in C on the CPU where the library is here)."""
    lib = native_library_for(qweight)
    if lib is None:
        return pack_nibbles(unpack_nibbles(qweight, 0)[rows.to(qweight.device)], 0)
    src, order = qweight.contiguous(), rows.to(torch.int64).contiguous()
    out = torch.empty_like(src)
    lib.w4_gather_rows(src.data_ptr(), order.data_ptr(), src.shape[0] * 8, src.shape[1],
                       out.data_ptr(), torch.get_num_threads())
    return out


def awq_to_internal(qweight: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM's `qweight [K, N/8]` (columns interleaved in each word) as the internal
    layout `[K/8, N]` (in C on the CPU where the library is here)."""
    from localpaged.quant.formats import AWQ_ORDER

    lib = native_library_for(qweight)
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if lib is None or k % 8:
        return pack_nibbles(unpack_nibbles(qweight, 1, AWQ_ORDER), 0)
    src = qweight.contiguous()
    out = torch.empty(k // 8, n, dtype=torch.int32)
    lib.w4_awq_to_internal(src.data_ptr(), k, n, out.data_ptr(), torch.get_num_threads())
    return out
