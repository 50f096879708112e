"""`QuantLinear`: a drop-in `nn.Linear` whose weight is 4-bit (`Int4Weight`), W4A16.

Devices:
* CUDA: the Triton W4A16 GEMM (`localpaged.quant.triton_w4a16`) on the internal layout.
* CPU, bfloat16: the package's own kernel (`localpaged.quant.cpu_w4`, compiled at first use),
  which unpacks each weight tile once for all rows (AMX or AVX512-BF16 where the CPU has
  them): fast from one row to a whole prefill chunk. torch's int4 op
  (`aten._weight_int4pack_mm_for_cpu`) is a little faster for a single row; `keep_single_row_op`
  keeps its packing too, for one-request decode steps.
* CPU without the kernel (no C compiler, float16, other shapes): torch's int4 op, converted once
  at load (N % 16 == 0, K % 32 == 0, group size a multiple of 32). It is made for few rows:
  `keep_dense_copy` adds a dequantized copy for batches of at least `dense_min_rows` rows.
* Float32 layers (the exact path), other shapes, and `LOCALPAGED_INT4_CPU=dequant` dequantize
  per call and use a dense matmul.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from localpaged.quant import cpu_w4
from localpaged.quant.ggml_int4 import GgmlInt4Weight
from localpaged.quant.layout import Int4Weight

CPU_GROUP_SIZES = (256, 128, 64, 32)  # what the CPU int4 op accepts
# The CPU op in float32 is several times slower than a dense float32 matmul (benchmarks/w4a16.py):
# float32 layers (the exact path) dequantize per call instead.
CPU_DTYPES = (torch.bfloat16, torch.float16)
# The CPU packing interleaves output channels in blocks of 64: packings join along N only at
# block boundaries.
CPU_PACK_BLOCK_N = 64


def _cpu_int4_ok() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and (
        os.environ.get("LOCALPAGED_INT4_CPU", "int4").lower() != "dequant"
    )


def cpu_subgroup(w: Int4Weight) -> int | None:
    """The CPU op's group size for `w` (a divisor of its group size), or None if unsupported."""
    k, n = w.in_features, w.out_features
    if n % 16:
        return None
    for sub in CPU_GROUP_SIZES:
        if w.group_size % sub == 0 and k % sub == 0:
            return sub
    return None


def to_cpu_int4pack(w: Int4Weight, sub: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 `[N, K/2]`, scale-and-zero `[K/sub, N, 2]`) for the CPU int4 op, which
    computes `(q - 8) * s + z`: so `z = (8 - zero) * s`."""
    codes = w.codes().t().contiguous()  # [N, K]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    s, z = w.scales.float(), w.zeros.float()
    if sub != w.group_size:  # (indexing is slow, and the identity where they are equal)
        g = (torch.arange(w.in_features // sub) * sub) // w.group_size
        s, z = s[g], z[g]
    return packed, torch.stack((s, (8 - z) * s), dim=-1).to(dtype).contiguous()


def read_in_one_order(layers: list[QuantLinear]) -> bool:
    """Whether `layers` take their input channels in one order: none permuted, or all by the
    same act-order permutation (then one matrix can hold them side by side)."""
    first = layers[0].perm
    return all((part.perm is None) == (first is None)
               and (first is None or torch.equal(part.perm, first)) for part in layers)


class QuantLinear(nn.Module):
    """`y = x @ W.T + b` with W held as 4-bit codes and per-group scales / zero-points."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.group_size = 0
        self.cpu_group_size = 0
        self.dense_min_rows = 0  # 0: no dense copy
        for name in ("qweight", "scales", "zeros", "perm", "cpu_packed", "cpu_scale_zeros",
                     "w4_packed", "w4_sb", "dense_weight"):
            self.register_buffer(name, None)
        self.register_buffer(
            "bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None
        )

    @classmethod
    def from_int4(
        cls, w: Int4Weight | GgmlInt4Weight, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device | str
    ) -> QuantLinear:
        """A layer holding `w` on `device`, computing in `dtype`."""
        layer = cls(w.in_features, w.out_features, bias is not None, dtype, device)
        layer.load(w, bias, device)
        return layer

    def load(
        self, w: Int4Weight | GgmlInt4Weight, bias: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        """Take `w` (and `bias`), converted for `device` (default: where `w` is; the CPU for
        a `GgmlInt4Weight`)."""
        if (w.in_features, w.out_features) != (self.in_features, self.out_features):
            raise ValueError(
                f"weight is [{w.out_features}, {w.in_features}], layer expects "
                f"[{self.out_features}, {self.in_features}]"
            )
        parts = isinstance(w, GgmlInt4Weight)  # a GGUF matrix, not packed yet
        default = torch.device("cpu") if parts else w.qweight.device
        device = torch.device(device) if device is not None else default
        if parts and device.type != "cpu":
            w, parts = w.to_int4(), False
        # The CPU packings take scale and offset (-zero * scale) from the parts as given
        # (float32 from the loaders) and round each once (float16 for the own kernel, the
        # compute dtype for torch's op); rounding the zero-point first would add its own
        # error to fractional ones (GGUF Q4_1, Q4_K).
        given = w.to(device) if device.type == "cpu" and not parts else w
        self.group_size = given.group_size
        self.perm = None if given.perm is None else given.perm.to(device)
        fast = device.type == "cpu" and self.dtype in CPU_DTYPES and _cpu_int4_ok()
        sub = cpu_subgroup(given) if fast else None
        # The own kernel takes bf16 and float32 activations (torch's int4 op: 16-bit only).
        # A float32 model takes it where it keeps the weight's numbers exactly, or where its
        # float32 activations are rounded to int8 anyway (then float16 scales cost nothing).
        own = (device.type == "cpu" and cpu_w4.supports(given, self.dtype) and cpu_w4.available()
               and (self.dtype != torch.float32 or cpu_w4.int8_activations()
                    or cpu_w4.holds_exactly(given)))
        self.qweight = self.scales = self.zeros = None
        if own:  # GGUF blocks go straight to the kernel's layout (the same bytes)
            quads = cpu_w4.quads_wanted(self.dtype)  # the int8 kernel's
            if parts:  # GGUF: whole groups of 32, always fit the quads layout
                packed, self.w4_sb = given.cpu_w4_pack(quads)
            else:
                packed, self.w4_sb = cpu_w4.pack(given)
                if quads and cpu_w4.fits_quads(packed, self.w4_sb):
                    packed = cpu_w4.to_quads(packed)
            self.w4_packed = packed
        # torch's int4 packing only where the own kernel does not take the layer: the own one
        # serves every batch, one row included (int8 activations there), faster.
        if sub is not None and not own:
            self.cpu_group_size = sub
            self.cpu_packed, self.cpu_scale_zeros = to_cpu_int4pack(given, sub, self.dtype)
        elif not own:
            w = (given.to_int4() if parts else given).to(device, self.dtype)
            self.qweight, self.scales, self.zeros = w.qweight, w.scales, w.zeros
        if bias is not None:
            if self.bias is None:
                raise ValueError("bias given for a layer built without one")
            self.bias = bias.to(device=device, dtype=self.dtype)

    def int4_weight(self) -> Int4Weight:
        """The weight in the internal layout (not kept on the CPU paths)."""
        if self.qweight is None:
            raise RuntimeError("this layer keeps only CPU packings")
        return Int4Weight(self.qweight, self.scales, self.zeros, self.group_size, self.perm)

    @torch.no_grad()
    def dequantized(self) -> torch.Tensor:
        """The weight `[N, K]` in the layer's dtype, in the original input-channel order."""
        if self.w4_packed is not None:
            w = cpu_w4.dequantize(self.w4_packed, self.w4_sb).to(self.dtype)
            if self.perm is not None:
                w = torch.empty_like(w).index_copy_(1, self.perm, w)
            return w.contiguous()
        if self.cpu_packed is None:
            return self.int4_weight().dequantize(self.dtype)
        # The CPU op applied to the identity returns W.T exactly: one product per output.
        eye = torch.eye(self.in_features, dtype=self.dtype, device=self.cpu_packed.device)
        w = torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.cpu_packed, self.cpu_group_size, self.cpu_scale_zeros).t()
        if self.perm is not None:  # column i of w belongs to input channel perm[i]
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w.contiguous()

    def keep_single_row_op(self, keep: bool) -> None:
        """Keep (or drop) torch's int4 packing beside the own kernel's, for one-row inputs."""
        if not keep and self.w4_packed is not None:
            self.cpu_packed = self.cpu_scale_zeros = None

    def keep_dense_copy(self, min_rows: int) -> None:
        """Also hold the dequantized weight and use it for inputs of >= `min_rows` rows."""
        if self.dense_weight is None:
            self.dense_weight = self.dequantized()
        self.dense_min_rows = min_rows

    @classmethod
    def concat(cls, layers: list[QuantLinear]) -> QuantLinear:
        """One layer computing the outputs of `layers` (same input) side by side, so one
        matmul replaces several (q/k/v, gate/up). Raises ValueError if they cannot be joined."""
        first = layers[0]
        same = all(
            (part.in_features, part.dtype, part.group_size, part.cpu_group_size, part.dense_min_rows)
            == (first.in_features, first.dtype, first.group_size, first.cpu_group_size,
                first.dense_min_rows)
            and (part.bias is None) == (first.bias is None)
            for part in layers) and read_in_one_order(layers)
        if not same:
            raise ValueError("layers differ in input size, dtype, grouping, bias or act-order")
        if any((part.w4_packed is None) != (first.w4_packed is None)
               or (part.cpu_packed is None) != (first.cpu_packed is None) for part in layers):
            raise ValueError("layers are packed for different kernels")
        torch_joins = all(part.out_features % CPU_PACK_BLOCK_N == 0 for part in layers[:-1])
        if first.cpu_packed is not None and first.w4_packed is None and not torch_joins:
            raise ValueError(f"CPU-packed layers join only at multiples of {CPU_PACK_BLOCK_N} "
                             "output channels")
        device = next(t for t in (first.w4_packed, first.cpu_packed, first.qweight)
                      if t is not None).device
        out = cls(first.in_features, sum(part.out_features for part in layers), first.bias is not None,
                  first.dtype, device)
        out.group_size, out.cpu_group_size, out.perm = first.group_size, first.cpu_group_size, first.perm
        out.dense_min_rows = first.dense_min_rows

        def cat(name: str, dim: int) -> torch.Tensor | None:
            parts = [getattr(part, name) for part in layers]
            return None if parts[0] is None else torch.cat(parts, dim)

        # Own kernel: [N/16, K/2, 16] (or quads [N/16, K/4, 32], alike in every part: the
        # layout follows dtype, K and group size) and [N/16, G, 2, 16]; torch's CPU packing: [N, K/2] and
        # [K/sub, N, 2]; internal: [K/8, N] and [G, N]; dense [N, K].
        out.w4_packed, out.w4_sb = cat("w4_packed", 0), cat("w4_sb", 0)
        if torch_joins:  # else the own kernel serves single rows too
            out.cpu_packed, out.cpu_scale_zeros = cat("cpu_packed", 0), cat("cpu_scale_zeros", 1)
        out.qweight, out.scales, out.zeros = cat("qweight", 1), cat("scales", 1), cat("zeros", 1)
        out.dense_weight, out.bias = cat("dense_weight", 0), cat("bias", 0)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.dense_weight is not None and x2.shape[0] >= self.dense_min_rows:
            y = torch.nn.functional.linear(x2.to(self.dtype), self.dense_weight, self.bias)
            return y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        if self.w4_packed is not None and (x2.shape[0] > 1 or self.cpu_packed is None):
            y = cpu_w4.matmul(x2.to(self.dtype), self.w4_packed, self.w4_sb)
        elif self.cpu_packed is not None:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(self.dtype).contiguous(), self.cpu_packed, self.cpu_group_size,
                self.cpu_scale_zeros,
            )
        elif x2.is_cuda:
            from localpaged.quant.triton_w4a16 import w4a16_matmul

            y = w4a16_matmul(x2.to(self.dtype), self.qweight, self.scales, self.zeros, self.group_size)
        else:
            w = self.int4_weight()
            w.perm = None  # x is already permuted
            y = x2.to(self.dtype) @ w.dequantize(self.dtype).t()
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        path = "cpu-w4" if self.w4_packed is not None else ""
        if self.cpu_packed is not None:
            path += ", torch int4 for one row" if path else "cpu-int4"
        path = path or "int4"
        if self.dense_weight is not None:
            path += f", dense for >= {self.dense_min_rows} rows"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, act_order={self.perm is not None}, {path}")


class QuantEmbedding(nn.Module):
    """Rows of a 4-bit matrix on the own CPU kernel (a `QuantLinear`'s tiles) as embeddings
    of `dtype`: a GGUF Q4 token embedding held once, in its bits, and (tied) the output layer
    too, where a dense copy would be 4-8 times its size and a decode step would read it all."""

    def __init__(self, linear: QuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        if linear.w4_packed is None or linear.perm is not None:
            raise ValueError("QuantEmbedding takes a layer on the own CPU kernel (no act-order)")
        self.table = linear  # shared with a tied lm_head: not a second copy
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = linear.out_features, linear.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = cpu_w4.checked_ids(ids, self.num_embeddings)
        tiles, where = torch.unique(flat // cpu_w4.TILE, return_inverse=True)
        rows = cpu_w4.dequantize(self.table.w4_packed[tiles], self.table.w4_sb[tiles])
        out = rows[where * cpu_w4.TILE + flat % cpu_w4.TILE]  # each tile's 16 rows, in order
        return out.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, 4-bit"
