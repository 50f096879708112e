"""Rotary embedding tables: the [max_positions, rotary_dim] cos|sin layout that
`localpaged.kernels.rotary` reads, for the rope kinds of the Llama family (rotary_dim is
head_dim but for partial rotary, Phi-4-mini's).

Kinds: default, linear, dynamic, llama3, yarn, longrope. "dynamic" (NTK) is built statically at
max_position_embeddings, where its base equals the unscaled one; HF only rescales past that
length, which the cache table does not reach.

LongRoPE (Phi-3/4) has two sets of frequencies: short factors for sequences up to
original_max_position_embeddings, long ones past it. Its table holds both, one after the
other ([2 * max_positions, rotary_dim]); a request reads the set its prompt length picks from
`table_offset` on (positions + offset index the table). The rule, per request and fixed for
its life: a prompt longer than original_max_position_embeddings takes the long factors for
all its tokens, prompt and answer; any other the short ones, also when its answer runs past
that length. That is transformers' choice for the prompt's forward pass and its decode steps,
except that transformers switches a short prompt's later tokens to the long factors once the
sequence passes the original length (its cached K/V staying short). Blocks computed with one
set are never reused by a request reading the other (the engine salts their prefix-cache
hashes with the offset), so a chat's turn that crosses the length recomputes its history.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from localpaged.model.config import ModelConfig


def inv_freq_and_scale(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim / 2] (float32) and the cos/sin attention scaling (for
    longrope: of its short factors; see `_longrope`)."""
    dim = config.rotary_dim
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
    if kind == "longrope":
        return _longrope(config, scaling, long=False)
    raise ValueError(f"rope type {kind!r} is not supported; supported: "
                     "default, linear, dynamic, llama3, yarn, longrope")


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


def _longrope(config: ModelConfig, s: dict[str, Any], long: bool) -> tuple[torch.Tensor, float]:
    """transformers' `_compute_longrope_parameters`: the short or long factors divide the
    frequencies; cos/sin are scaled by sqrt(1 + ln(factor) / ln(original)), factor being
    max_position_embeddings / original_max_position_embeddings unless given."""
    dim, base = config.rotary_dim, config.rope_theta
    orig = int(s["original_max_position_embeddings"])
    factor = s.get("factor") or config.max_position_embeddings / orig
    attn = s.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32)
    if ext.shape != (dim // 2,):
        raise ValueError(f"longrope factors: {tuple(ext.shape)} values, expected {dim // 2} "
                         f"(rotary dim {dim} / 2)")
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * base**shape), float(attn)


def table_offset(config: ModelConfig, num_prompt_tokens: int) -> int:
    """The row of `build_cos_sin`'s table where a request of `num_prompt_tokens` prompt tokens
    reads position 0: past the short set for a longrope prompt longer than the original
    length (see the module's docstring), else 0."""
    s = config.rope_scaling or {}
    if s.get("rope_type") == "longrope" and num_prompt_tokens > s["original_max_position_embeddings"]:
        return config.max_position_embeddings
    return 0


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
    """float32 [max_positions, rotary_dim]: cos(pos * f) * s | sin(pos * f) * s. For longrope
    the short set's rows, then the long set's (2 * max_positions rows)."""
    n = max_positions or config.max_position_embeddings
    sets = [inv_freq_and_scale(config)]
    if config.rope_type == "longrope":
        sets.append(_longrope(config, config.rope_scaling or {}, long=True))
    tables = []
    for inv_freq, scale in sets:
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)
        tables.append(torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1))
    return torch.cat(tables).to(device)
