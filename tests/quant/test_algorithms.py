"""GPTQ and AWQ on single synthetic layers: what each algorithm promises."""

from __future__ import annotations

import torch

from localpaged.quant.awq import (
    apply_clip,
    awq_quantize,
    pseudo_quantize,
    search_clip,
    search_scale,
)
from localpaged.quant.gptq import gptq_params, gptq_quantize


def _rtn(w: torch.Tensor, gs: int, sym: bool) -> torch.Tensor:
    """Round-to-nearest with GPTQ's scale/zero rule, `W[N, K]` dequantized."""
    k = w.shape[1]
    out = torch.empty_like(w)
    for g0 in range(0, k, gs):
        s, z = gptq_params(w[:, g0 : g0 + gs], sym)
        q = torch.clamp(torch.round(w[:, g0 : g0 + gs] / s[:, None]) + z[:, None], 0, 15)
        out[:, g0 : g0 + gs] = (q - z[:, None]) * s[:, None]
    return out


def _correlated_inputs(t: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)
    return torch.randn(t, k, generator=g) @ mix * (torch.rand(k, generator=g) * 3 + 0.1)


def test_gptq_with_identity_hessian_is_rtn() -> None:
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    for sym in (True, False):
        q = gptq_quantize(w, torch.eye(64), 32, sym=sym, damp_percent=0.0)
        torch.testing.assert_close(q.dequantize(), _rtn(w, 32, sym), rtol=0, atol=1e-3)


def test_gptq_beats_rtn_on_calibration_outputs() -> None:
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    x = _correlated_inputs(1024, 128, seed=2)
    h = x.t() @ x
    for sym, act_order in ((True, False), (False, True)):
        q = gptq_quantize(w, h, 32, sym=sym, act_order=act_order)
        err_gptq = (x @ (q.dequantize() - w).t()).pow(2).mean()
        err_rtn = (x @ (_rtn(w, 32, sym) - w).t()).pow(2).mean()
        assert err_gptq < 0.8 * err_rtn, (sym, act_order, err_gptq, err_rtn)
        assert int(q.codes.min()) >= 0 and int(q.codes.max()) <= 15
        if act_order:  # groups follow descending Hessian diagonal, 32 channels each
            assert torch.equal(torch.bincount(q.g_idx.long()), torch.full((4,), 32))
            top = torch.argsort(torch.diag(h), descending=True)[:32]
            assert (q.g_idx[top] == 0).all()


def test_awq_quantize_matches_pseudo_quantize() -> None:
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(3))
    q = awq_quantize(w, 64)
    torch.testing.assert_close(q.dequantize(), pseudo_quantize(w, 64), rtol=0, atol=1e-3)


def test_awq_scale_and_clip_beat_rtn_with_salient_channels() -> None:
    g = torch.Generator().manual_seed(4)
    w = torch.randn(64, 128, generator=g)
    x = torch.randn(512, 128, generator=g)
    x[:, :4] *= 30  # a few salient input channels, as in real activations
    s = search_scale(x, [w], lambda ws: x @ ws[0].t(), 64)
    scaled = w * s
    clip = search_clip(x / s, scaled, 64)
    q = awq_quantize(apply_clip(scaled, clip, 64), 64).dequantize() / s
    err_awq = (x @ (q - w).t()).pow(2).mean()
    err_rtn = (x @ (pseudo_quantize(w, 64) - w).t()).pow(2).mean()
    assert err_awq < 0.7 * err_rtn, (err_awq, err_rtn)
    assert s[:4].mean() > s[4:].mean()  # the salient channels are scaled up


def test_mse_range_search_never_worse() -> None:
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(5))
    w[::7, 3] *= 8  # outliers make shrinking the range pay off
    for sym in (True, False):
        errs = []
        for mse in (False, True):
            s, z = gptq_params(w, sym, mse)
            q = torch.clamp(torch.round(w / s[:, None]) + z[:, None], 0, 15)
            errs.append(((q - z[:, None]) * s[:, None] - w).abs().pow(2.4).sum(1))
        assert (errs[1] <= errs[0] + 1e-6).all() and (errs[1] < errs[0]).any()
