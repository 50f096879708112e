"""Rotary embedding tables: the [max_positions, head_dim] cos|sin layout that
`localpaged.kernels.rotary` reads, for the rope kinds of the Llama family.

Kinds: default, linear, dynamic, llama3, yarn. "dynamic" (NTK) is built statically at
max_position_embeddings, where its base equals the unscaled one; HF only rescales past that
length, which the cache table does not reach.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from localpaged.model.config import ModelConfig


def inv_freq_and_scale(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] (float32) and the cos/sin attention scaling."""
    dim = config.head_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind in ("default", "dynamic"):
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(config, scaling)
    raise ValueError(f"rope type {kind!r} is not supported; supported: "
                     "default, linear, dynamic, llama3, yarn")


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(config: ModelConfig, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    dim, base = config.head_dim, config.rope_theta
    orig = s.get("original_max_position_embeddings") or config.max_position_embeddings
    factor = s.get("factor") or config.max_position_embeddings / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrap = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
    return inv_freq, float(attn)


def build_cos_sin(
    config: ModelConfig, device: torch.device | str = "cpu", max_positions: int | None = None
) -> torch.Tensor:
    """float32 [max_positions, head_dim]: cos(pos * f) * s | sin(pos * f) * s."""
    n = max_positions or config.max_position_embeddings
    inv_freq, scale = inv_freq_and_scale(config)
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)
    table = torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1)
    return table.to(device)
