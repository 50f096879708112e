"""RMSNorm, SiLU-and-mul and rotary embedding on the CPU in bf16 or float32 through the native
layer library (`cpu/decode_layer.c`): one vectorized pass over the rows instead of torch's chain
of float32 temporaries. Same results as the torch implementations (float32 inside, the
tensor's dtype between steps)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from localpaged.kernels import native

_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def supports(x: torch.Tensor) -> bool:
    """Whether the layers take the native path for `x`: a bf16 CPU tensor (any leading shape).
    Float32 layers keep torch's ops: with int8 activations a last-bit difference before a
    matmul moves codes, and the float32 ops measured no faster than torch's at prefill."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and native.available()


def _fn(name: str, dtype: torch.dtype) -> Callable[..., None]:
    """The library's `<name>_<bf16|f32>` entry point for `dtype`."""
    return getattr(native.library(), f"{name}_{_SUFFIX[dtype]}")


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual), as `rms_norm_torch`."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    r2 = residual.reshape(-1, n).contiguous() if residual is not None else None
    w = weight.to(x2.dtype).contiguous()
    out, res_out = torch.empty_like(x2), torch.empty_like(x2)
    if x2.shape[0]:
        _fn("rms_norm_rows", x2.dtype)(
            x2.data_ptr(), r2.data_ptr() if r2 is not None else None, res_out.data_ptr(),
            w.data_ptr(), out.data_ptr(), x2.shape[0], n, eps, torch.get_num_threads())
    return out.view(x.shape), (res_out.view(x.shape) if residual is not None else x)


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = cat(gate, up) along the last dim, as `silu_and_mul_torch`."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter).contiguous()
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype)
    if x2.shape[0]:
        _fn("silu_and_mul_rows", x2.dtype)(x2.data_ptr(), out.data_ptr(), x2.shape[0], inter,
                                           torch.get_num_threads())
    return out.view(*x.shape[:-1], inter)


def apply_rotary_cpu(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cos_sin: torch.Tensor, cache: dict | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place (rows may be strided, heads and the last
    dim contiguous), as `apply_rotary_triton` does. Returns (q, k)."""
    rows = cache.get("rotary.cpu_rows") if cache is not None else None
    if rows is None:
        rows = cos_sin.index_select(0, positions).float().contiguous()
        if cache is not None:
            cache["rotary.cpu_rows"] = rows
    if q.shape[0]:
        _fn("rotary_rows", q.dtype)(q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(),
                                     k.stride(0), k.shape[1], q.shape[2], rows.data_ptr(),
                                     q.shape[0], torch.get_num_threads())
    return q, k


def rotary_supports(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> bool:
    """Whether q and k can be rotated in place by `apply_rotary_cpu`."""
    d = q.shape[-1]
    return (supports(q) and k.dtype == q.dtype and cos_sin.shape[-1] == d and d % 2 == 0
            and all(t.stride(-1) == 1 and t.stride(1) == d for t in (q, k)))
