"""Load-time validation: which shapes and dtypes the kernels that will run support.

The engine calls `check_supported` when it loads a model, so an unsupported configuration is
an error naming the value and the supported ones, never a silent wrong result. The torch path
(CPU) is general; the Triton path is limited to the values its tests cover.
"""

from __future__ import annotations

import torch

from localpaged.kernels._triton import HAS_TRITON, UNAVAILABLE
from localpaged.kernels.backend import use_triton_on

TRITON_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
TRITON_BLOCK_SIZES = (4, 8, 16, 32, 64, 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _names(values: tuple) -> str:
    return ", ".join(str(v).replace("torch.", "") for v in values)


def check_supported(
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
) -> None:
    """Raise ValueError if the kernels chosen for `device` cannot run this configuration."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype} is not supported; supported: {_names(DTYPES)}")
    if block_size < 1:
        raise ValueError(f"block_size {block_size} is invalid: expected >= 1")
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} is not supported: rotary needs an even head_dim")
    if num_heads is not None and num_kv_heads is not None and num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    device = torch.device(device)
    if not use_triton_on(device):
        return
    if not HAS_TRITON:
        raise ValueError(f"the Triton kernels were selected: {UNAVAILABLE}")
    if head_dim not in TRITON_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported by the Triton kernels; "
                         f"supported: {_names(TRITON_HEAD_DIMS)}")
    if block_size not in TRITON_BLOCK_SIZES:
        raise ValueError(f"block_size {block_size} is not supported by the Triton kernels; "
                         f"supported: {_names(TRITON_BLOCK_SIZES)}")
    if (device.type == "cuda" and dtype == torch.bfloat16
            and torch.cuda.get_device_capability(device)[0] < 8):
        raise ValueError(f"dtype bfloat16 needs compute capability >= 8.0 on {device}; "
                         "supported here: float16, float32")
