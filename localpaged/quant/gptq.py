"""GPTQ (Frantar et al., 2022) for one linear layer: Hessian from calibration inputs, lazy
block updates, optional act-order; scale/zero choice as AutoGPTQ's `Quantizer.find_params`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAXQ = 15


@dataclass
class QuantizedLayer:
    """Result of quantizing `W[out, in]`: codes `[K, N]`, scales/zeros `[G, N]`, g_idx `[K]`."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    group_size: int

    def dequantize(self) -> torch.Tensor:
        """`W[out, in]` in float32, exactly as a reader of the written checkpoint computes it
        (scales rounded to float16 as stored)."""
        s = self.scales.half().float()[self.g_idx]
        z = self.zeros.float()[self.g_idx]
        return ((self.codes.float() - z) * s).t().contiguous()


def gptq_params(w: torch.Tensor, sym: bool, mse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (scale, integer zero) of `w [N, cols]`, as `Quantizer.find_params`: the range
    always includes 0; sym puts the zero-point at 8. `mse`: also try the range shrunk by
    1%..79% and keep, per row, the one with the least |error|^2.4 (AutoGPTQ's grid search)."""
    xmin = w.min(dim=1).values.clamp(max=0)
    xmax = w.max(dim=1).values.clamp(min=0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    both_zero = (xmin == 0) & (xmax == 0)
    xmin = torch.where(both_zero, -1.0, xmin)
    xmax = torch.where(both_zero, 1.0, xmax)
    scale, zero = _range_params(xmin, xmax, sym)
    if mse:
        best = torch.full_like(scale, float("inf"))
        for i in range(80):
            p = 1 - i / 100
            s1, z1 = _range_params(p * xmin, p * xmax, sym)
            q = torch.clamp(torch.round(w / s1[:, None]) + z1[:, None], 0, MAXQ)
            err = ((q - z1[:, None]) * s1[:, None] - w).abs().pow(2.4).sum(1)
            better = err < best
            best = torch.where(better, err, best)
            scale, zero = torch.where(better, s1, scale), torch.where(better, z1, zero)
    return scale, zero


def _range_params(xmin: torch.Tensor, xmax: torch.Tensor, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    scale = ((xmax - xmin) / MAXQ).clamp(min=1e-6)
    scale = scale.half().float()  # the checkpoint stores float16 scales: quantize against those
    if sym:
        return scale, torch.full_like(scale, (MAXQ + 1) / 2)
    # Zero-points start at 1, not 0: v1 files store zero - 1, and a stored -1 (nibble 0xF) is
    # read differently by AutoGPTQ-style (nibble-wise) and GPTQModel-style (word-wise) loaders
    # (QUANT_FORMATS.md §1.9). With zero >= 1 every reader decodes our files the same.
    return scale, torch.round(-xmin / scale).clamp(1, MAXQ)


def _quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.clamp(torch.round(w / scale) + zero, 0, MAXQ)
    return q, scale * (q - zero)


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    group_size: int,
    sym: bool = True,
    act_order: bool = False,
    damp_percent: float = 0.01,
    mse: bool = False,
) -> QuantizedLayer:
    """Quantize `weight [N, K]` given `hessian [K, K]` (sum of x x^T over calibration rows)."""
    w = weight.detach().float().clone()
    n, k = w.shape
    gs = k if group_size == -1 else group_size
    h = hessian.detach().float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]
    h += damp_percent * torch.mean(torch.diag(h)) * torch.eye(k)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    groups = -(-k // gs)
    scales = torch.zeros(groups, n)
    zeros = torch.zeros(groups, n)
    codes = torch.zeros(k, n, dtype=torch.int32)  # processing order
    wt = w.t().contiguous()  # [K, N]: a column of W is a contiguous row here
    block = gs * max(1, 128 // gs) if gs < k else 128
    scale = zero = None
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = wt[i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % gs == 0:  # a new group: its columns as updated so far
                g_end = min(col + gs, k)
                rows = w1[i : i + g_end - col] if g_end <= i2 else torch.cat(
                    (w1[i:], wt[i2:g_end]))
                scale, zero = gptq_params(rows.t(), sym, mse)
                scales[col // gs], zeros[col // gs] = scale, zero
            q, deq = _quantize(w1[i], scale, zero)
            codes[col] = q.to(torch.int32)
            err = (w1[i] - deq) / hinv1[i, i]
            w1[i:].addr_(hinv1[i, i:], err, alpha=-1)  # lazy update inside the block
            err1[i] = err
        wt[i2:].addmm_(hinv[i1:i2, i2:].t(), err1, alpha=-1)  # then the rest, once per block
    invperm = torch.argsort(perm)
    g_idx = (torch.arange(k) // gs)[invperm].to(torch.int32)
    return QuantizedLayer(codes[invperm], scales, zeros.to(torch.int32), g_idx, gs)
