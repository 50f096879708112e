"""AWQ (Lin et al., 2023) for one group of linears sharing an input: the activation-aware
per-input-channel scale search and the weight-clipping search, as AutoAWQ's
`AwqQuantizer._search_best_scale` / `_search_best_clip`; asymmetric min/max quantization
as `pseudo_quantize_tensor`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from localpaged.quant.gptq import MAXQ, QuantizedLayer

N_GRID = 20
MAX_SHRINK = 0.5


def awq_params(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (scale, integer zero) of `w [rows, gs]` over its actual min/max."""
    wmax, wmin = w.amax(dim=1), w.amin(dim=1)
    scale = ((wmax - wmin).clamp(min=1e-5) / MAXQ).half().float()  # stored as float16
    zero = torch.clamp(-torch.round(wmin / scale), 0, MAXQ)
    return scale, zero


def pseudo_quantize(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Quantize-dequantize `w [N, K]` group-wise (what the checkpoint will hold)."""
    n, k = w.shape
    g = w.reshape(-1, group_size)
    scale, zero = awq_params(g)
    q = torch.clamp(torch.round(g / scale[:, None]) + zero[:, None], 0, MAXQ)
    return ((q - zero[:, None]) * scale[:, None]).reshape(n, k)


def awq_quantize(weight: torch.Tensor, group_size: int) -> QuantizedLayer:
    """Final quantization of an (already scaled and clipped) `weight [N, K]`."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of group_size {group_size} (AWQ)")
    g = weight.detach().float().reshape(n, k // group_size, group_size)
    scale, zero = awq_params(g.reshape(-1, group_size))
    scale, zero = scale.view(n, -1), zero.view(n, -1)
    q = torch.clamp(torch.round(g / scale[..., None]) + zero[..., None], 0, MAXQ)
    codes = q.reshape(n, k).t().to(torch.int32).contiguous()
    g_idx = (torch.arange(k) // group_size).to(torch.int32)
    return QuantizedLayer(codes, scale.t().contiguous(), zero.t().to(torch.int32).contiguous(),
                          g_idx, group_size)


@torch.no_grad()
def search_scale(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    forward: Callable[[Sequence[torch.Tensor]], torch.Tensor],
    group_size: int,
) -> torch.Tensor:
    """The per-input-channel scale `s [K]` minimizing `|forward(Q(W * s) / s) - forward(W)|^2`
    over the grid `s = x_mean^a / w_mean^(1-a)`, a in {0, 1/20, ..., 19/20}.

    x: the linears' input rows `[T, K]`; forward(ws) runs the inspected module with the
    linears' weights replaced by `ws`."""
    w_all = torch.cat([w.float() for w in weights], dim=0)
    w_abs = w_all.abs().reshape(-1, group_size)
    w_norm = (w_abs / w_abs.amax(dim=1, keepdim=True).clamp(min=1e-12)).reshape(w_all.shape)
    w_mean = w_norm.mean(0)
    x_mean = x.abs().reshape(-1, x.shape[-1]).float().mean(0)
    reference = forward(list(weights))
    best, best_scales = float("inf"), torch.ones_like(x_mean)
    for i in range(N_GRID):
        ratio = i / N_GRID
        s = (x_mean.pow(ratio) / w_mean.pow(1 - ratio).clamp(min=1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        trial = [pseudo_quantize(w.float() * s, group_size) / s for w in weights]
        loss = (reference - forward(trial)).float().pow(2).mean().item()
        if loss < best:
            best, best_scales = loss, s
    return best_scales


@torch.no_grad()
def search_clip(x: torch.Tensor, weight: torch.Tensor, group_size: int, n_tokens: int = 512) -> torch.Tensor:
    """Per-(row, group) clip bound `[N, K / gs]` minimizing the group-wise output error of the
    clipped-and-quantized weight on (a sample of) the input rows `x [T, K]`."""
    w = weight.float()
    n, k = w.shape
    x = x.reshape(-1, k).float()
    x = x[:: max(1, x.shape[0] // n_tokens)][:n_tokens]
    xg = x.t().reshape(k // group_size, group_size, -1)  # [G, gs, T]
    return torch.cat([_clip_rows(w[r : r + 256], xg, group_size) for r in range(0, n, 256)])


def _clip_rows(w: torch.Tensor, xg: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = w.shape
    wg = w.reshape(n, k // group_size, group_size)  # [N, G, gs]
    out_ref = torch.einsum("ngs,gst->ngt", wg, xg)
    org_max = wg.abs().amax(dim=-1)  # [N, G]
    best_max = org_max.clone()
    best_err = torch.full_like(org_max, float("inf"))
    for i in range(int(MAX_SHRINK * N_GRID)):
        max_val = org_max * (1 - i / N_GRID)
        clipped = torch.clamp(wg, -max_val[..., None], max_val[..., None])
        q = pseudo_quantize(clipped.reshape(n, k), group_size).reshape(wg.shape)
        err = (torch.einsum("ngs,gst->ngt", q, xg) - out_ref).pow(2).mean(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, max_val, best_max)
    return best_max


def apply_clip(weight: torch.Tensor, max_val: torch.Tensor, group_size: int) -> torch.Tensor:
    """`weight` clamped group-wise to `[-max_val, max_val]`."""
    n, k = weight.shape
    wg = weight.reshape(n, k // group_size, group_size)
    return torch.clamp(wg, -max_val[..., None], max_val[..., None]).reshape(n, k).to(weight.dtype)
