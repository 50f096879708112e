"""Rotary position embedding (NeoX / HF "rotate_half" layout) applied to q and k.

`cos_sin` is a [max_positions, rotary_dim] table: cos in the first half of the last dim,
sin in the second (built by `localpaged.model.rope`, which owns the rope-scaling kinds, Llama 3
included: the kernels only read the table). A rotary_dim below head_dim is partial rotary
(Phi-4-mini): the first rotary_dim dims of each head rotate as a head of that size would, the
rest pass through unchanged. The native CPU kernel takes full rotary only (others fall back to
torch).
"""

from __future__ import annotations

import torch

from localpaged.kernels import elementwise_cpu
from localpaged.kernels._triton import jit, next_pow2, require_triton, tl
from localpaged.kernels.backend import use_triton


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos: [T, 1, D] (cos twice), sin: [T, 1, D] (-sin, then sin).
    x * cos + rotate_half(x) * sin in float32, where rotate_half(x) = (-x2, x1)."""
    t, h, d = x.shape
    xf = x.float()
    swapped = xf.view(t, h, 2, d // 2).flip(2).view(t, h, d)  # (x2, x1)
    return (xf * cos + swapped * sin).to(x.dtype)


def _cos_sin_rows(cos_sin: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The step's rows of the table, widened for `_rotate`: [T, 1, D] cos and signed sin."""
    cos, sin = cos_sin.index_select(0, positions).unsqueeze(1).float().chunk(2, dim=-1)
    return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)


def apply_rotary_torch(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    cache: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch implementation. q: [T, Hq, D], k: [T, Hkv, D], positions: [T]. `cache` (a dict
    that lives for one step, shared by the layers) keeps the step's cos/sin rows."""
    rows = cache.get("rotary.cos_sin") if cache is not None else None
    if rows is None:
        rows = _cos_sin_rows(cos_sin, positions)
        if cache is not None:
            cache["rotary.cos_sin"] = rows
    num_q_heads, rot = q.shape[1], cos_sin.shape[-1]
    qk = torch.cat((q, k), dim=1)  # q and k in one pass
    if rot < q.shape[-1]:  # partial rotary: the dims past rot pass through
        qk = torch.cat((_rotate(qk[..., :rot].contiguous(), *rows), qk[..., rot:]), dim=-1)
    else:
        qk = _rotate(qk, *rows)
    return qk[:, :num_q_heads], qk[:, num_q_heads:]


@jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cs_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
):
    """One program per token: rotate all its q heads and k heads in place, in float32."""
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    d_mask = d < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d, mask=d_mask, other=0.0).to(tl.float32)
    sin = sin[None, :]

    hq = tl.arange(0, HQ_PAD)[:, None]
    mq = (hq < NUM_Q_HEADS) & d_mask[None, :]
    q1_ptr = q_ptr + tok * stride_qt + hq * stride_qh + d[None, :]
    q1 = tl.load(q1_ptr, mask=mq, other=0.0).to(tl.float32)
    q2 = tl.load(q1_ptr + HALF, mask=mq, other=0.0).to(tl.float32)
    q_ty = q_ptr.dtype.element_ty
    tl.store(q1_ptr, (q1 * cos - q2 * sin).to(q_ty), mask=mq)
    tl.store(q1_ptr + HALF, (q2 * cos + q1 * sin).to(q_ty), mask=mq)

    hk = tl.arange(0, HK_PAD)[:, None]
    mk = (hk < NUM_KV_HEADS) & d_mask[None, :]
    k1_ptr = k_ptr + tok * stride_kt + hk * stride_kh + d[None, :]
    k1 = tl.load(k1_ptr, mask=mk, other=0.0).to(tl.float32)
    k2 = tl.load(k1_ptr + HALF, mask=mk, other=0.0).to(tl.float32)
    k_ty = k_ptr.dtype.element_ty
    tl.store(k1_ptr, (k1 * cos - k2 * sin).to(k_ty), mask=mk)
    tl.store(k1_ptr + HALF, (k2 * cos + k1 * sin).to(k_ty), mask=mk)


def apply_rotary_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of `apply_rotary_torch`, in place on q and k (views allowed:
    any strides with a contiguous last dim). Returns (q, k). A table narrower than head_dim
    rotates the first dims only (partial rotary)."""
    require_triton()
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rot = cos_sin.shape[-1]
    if rot > head_dim or rot % 2 or rot == 0:
        raise ValueError(f"rotary table width {rot} must be even and at most head_dim {head_dim}")
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin.stride(-1) == 1
    if num_tokens:
        half = rot // 2
        _rotary_kernel[(num_tokens,)](
            q, k, positions, cos_sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
            NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
            HQ_PAD=next_pow2(num_q_heads), HK_PAD=next_pow2(num_kv_heads),
            HALF_PAD=next_pow2(half),
        )
    return q, k


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    cache: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] by their token positions. Returns (q, k); the
    Triton and native CPU paths rotate in place and return the same tensors. `cache`: see the
    torch path."""
    if use_triton(q):
        return apply_rotary_triton(q, k, positions, cos_sin)
    if elementwise_cpu.rotary_supports(q, k, cos_sin):
        return elementwise_cpu.apply_rotary_cpu(q, k, positions, cos_sin, cache)
    return apply_rotary_torch(q, k, positions, cos_sin, cache)
