"""Guarded Triton import shared by the op modules.

Triton is imported only where its kernels can run: with CUDA, or on the CPU when its
interpreter is asked for before the first import (`TRITON_INTERPRET=1`, or
`LOCALPAGED_KERNELS=triton`, which turns the interpreter on). A CPU run otherwise never
launches a Triton kernel, and importing it cost 150 ms and 71 MiB of resident memory
(libtriton) in every process. Triton decides at *its own import* whether `@triton.jit`
compiles for the GPU or interprets on the CPU. Where Triton is not imported (or missing:
macOS) the op modules still import: `jit` leaves the kernel functions undecorated and
`HAS_TRITON` is False.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch


def _wanted() -> bool:
    """Whether this process imports Triton (see the module's docstring)."""
    if "triton" in sys.modules or torch.cuda.is_available():
        return True
    if os.environ.get("LOCALPAGED_KERNELS", "").lower() == "triton":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"


triton: Any = None
tl: Any = None
HAS_TRITON = False
if _wanted():
    try:
        import triton
        import triton.language as tl

        HAS_TRITON = True
    except ImportError:  # pragma: no cover - macOS / no triton wheel
        pass


UNAVAILABLE = ("Triton is not loaded: it is with CUDA, or on the CPU when TRITON_INTERPRET=1 or "
               "LOCALPAGED_KERNELS=triton is set before start (and `pip install triton` where "
               "it is missing); else use LOCALPAGED_KERNELS=torch")


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
        raise RuntimeError(UNAVAILABLE)


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum) (tl.arange sizes must be powers of two)."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def is_cpu(t: torch.Tensor) -> bool:
    """Kernels on CPU tensors run in the interpreter: keep launch shapes small there."""
    return not t.is_cuda
