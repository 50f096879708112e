"""Ops of the forward pass. Each op: a Triton kernel for CUDA and a torch implementation
(the CPU backend and the test reference) behind one function that picks by device
(see backend.py). `check_supported` validates a model's shapes and dtype at load time."""

from localpaged.kernels.activation import silu_and_mul
from localpaged.kernels.attention import AttentionMetadata, paged_attention
from localpaged.kernels.kv_write import write_kv
from localpaged.kernels.rms_norm import rms_norm
from localpaged.kernels.rotary import apply_rotary
from localpaged.kernels.supports import check_supported

__all__ = [
    "AttentionMetadata",
    "apply_rotary",
    "check_supported",
    "paged_attention",
    "rms_norm",
    "silu_and_mul",
    "write_kv",
]
