"""Which implementation an op runs: Triton on CUDA, torch elsewhere.

`LOCALPAGED_KERNELS=torch` forces the torch path (debugging); `LOCALPAGED_KERNELS=triton`
with `TRITON_INTERPRET=1` runs the Triton kernels on the CPU (slow, for checking).
"""

from __future__ import annotations

import os

import torch

_CHOICES = ("auto", "torch", "triton")


def use_triton_on(device: torch.device | str) -> bool:
    """True when ops on tensors of `device` should run their Triton kernels."""
    choice = os.environ.get("LOCALPAGED_KERNELS", "auto").lower()
    if choice not in _CHOICES:
        raise ValueError(f"LOCALPAGED_KERNELS={choice!r}: expected one of {', '.join(_CHOICES)}")
    if choice == "torch":
        return False
    is_cuda = torch.device(device).type == "cuda"
    if choice == "triton":
        return is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return is_cuda


def use_triton(t: torch.Tensor) -> bool:
    """True when the op on tensor `t` should run its Triton kernel. (Called by every op of
    every layer: the common CPU case costs two dictionary lookups.)"""
    if t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return use_triton_on(t.device)
    choice = os.environ.get("LOCALPAGED_KERNELS", "auto").lower()
    if choice not in _CHOICES:
        raise ValueError(f"LOCALPAGED_KERNELS={choice!r}: expected one of {', '.join(_CHOICES)}")
    return False
