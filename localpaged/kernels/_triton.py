"""Guarded Triton import shared by the op modules.

Triton decides at *its own import* whether `@triton.jit` compiles for the GPU or interprets on
the CPU (`TRITON_INTERPRET=1`; its standard library is decorated then too). On a machine without
CUDA the compiled mode can never run, so when this module is the first to import Triton there,
it turns the interpreter on. Where Triton is missing (macOS) the op modules still import: `jit`
leaves the kernel functions undecorated and `HAS_TRITON` is False.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - macOS / no triton wheel
    triton = None
    tl = None
    HAS_TRITON = False


def jit(fn: Callable[..., Any]) -> Any:
    """`triton.jit` where Triton is installed; the bare function otherwise (never launched)."""
    return triton.jit(fn) if HAS_TRITON else fn


def interpreter_active() -> bool:
    """True when Triton was imported in interpreter mode (kernels run on CPU tensors)."""
    if not HAS_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.zeros, InterpretedFunction)


def require_triton() -> None:
    """Raise a clear error when a Triton kernel is asked for where Triton is missing."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed: use LOCALPAGED_KERNELS=torch")


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum) (tl.arange sizes must be powers of two)."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def is_cpu(t: torch.Tensor) -> bool:
    """Kernels on CPU tensors run in the interpreter: keep launch shapes small there."""
    return not t.is_cuda
