"""W4A16 GEMM in Triton: `y[M, N] = x[M, K] @ W.T`, W read from the internal int4 layout
(`qweight [K/8, N]` int32, `scales`/`zeros` `[G, N]`) and dequantized in-kernel.

Two launch shapes of one kernel: a prefill path (many rows: 2-D tiles over M and N, the whole
K loop per program) and a decode path (few rows: one 16-row M tile, K split over programs
that add their partial sums into a float32 output, so a decode step still fills the GPU).
"""

from __future__ import annotations

import torch

from localpaged.kernels._triton import is_cpu, jit, require_triton, tl

DECODE_MAX_ROWS = 16


@jit
def _w4a16_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr,
    M, N, K, group_size,
    stride_xm, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Program (pid_m, pid_n, pid_k): rows pid_m*BLOCK_M.., columns pid_n*BLOCK_N.., and every
    SPLIT_K-th BLOCK_K slice of K starting at pid_k."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        wmask = mask_k[:, None] & mask_n[None, :]
        # Each int32 word holds 8 consecutive K rows of one column: row k is nibble k % 8.
        words = tl.load(qw_ptr + (offs_k[:, None] // 8).to(tl.int64) * N + offs_n[None, :],
                        mask=wmask, other=0)
        codes = (words >> ((offs_k[:, None] % 8) * 4)) & 0xF
        g = (offs_k // group_size).to(tl.int64)
        scale = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=wmask, other=0.0)
        zero = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=wmask, other=0.0)
        w = (codes.to(tl.float32) - zero.to(tl.float32)) * scale.to(tl.float32)
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w)
        else:
            acc += tl.dot(x, w.to(x.dtype))
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    omask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(out_ptrs, acc, mask=omask)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


def w4a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """`x [M, K]` (fp16 / bf16 / fp32) times the int4 weight: `[M, N]` in x's dtype."""
    require_triton()
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.shape[0] * 8 != k:
        raise ValueError(f"x has K={k} but qweight holds {qweight.shape[0] * 8} input rows")
    x, qweight = x.contiguous(), qweight.contiguous()
    scales, zeros = scales.contiguous(), zeros.contiguous()
    interp = is_cpu(x)
    if m <= DECODE_MAX_ROWS:  # decode: one M tile, K split across programs
        block_m, block_n, block_k = 16, 32 if interp else 64, 32 if interp else 128
        split_k = max(1, min(k // block_k, 4 if interp else 8))
    else:  # prefill
        block_m, block_n, block_k = (16, 32, 32) if interp else (64, 64, 64)
        split_k = 1
    out_dtype = torch.float32 if split_k > 1 else x.dtype
    out = (torch.zeros if split_k > 1 else torch.empty)((m, n), dtype=out_dtype, device=x.device)
    grid = (triton_cdiv(m, block_m), triton_cdiv(n, block_n), split_k)
    _w4a16_kernel[grid](
        x, qweight, scales, zeros, out, m, n, k, group_size, x.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        DOT_FP32=interp or x.dtype == torch.float32,
    )
    return out.to(x.dtype)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def w4a16_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Torch reference: dequantize to float32, then matmul (the test oracle)."""
    from localpaged.quant.layout import Int4Weight

    w = Int4Weight(qweight, scales, zeros, group_size).dequantize()
    return (x.float() @ w.t()).to(x.dtype)
