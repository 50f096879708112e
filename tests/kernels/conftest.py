"""Kernel tests: every Triton kernel against its torch implementation.

Without CUDA the kernels run in Triton's interpreter on CPU tensors; TRITON_INTERPRET=1 must be
set before Triton is first imported (localpaged.kernels._triton also sets it on CUDA-less
machines). With `TRITON_INTERPRET=0` on a CUDA machine (scripts/gpu_check.sh) the same tests
run compiled on the GPU. Triton picks its mode once per process, so one run tests one device.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from localpaged.kernels._triton import HAS_TRITON, interpreter_active


def kernel_devices() -> list[str]:
    """"cuda" when Triton compiles and a GPU is present, else "cpu" (the interpreter)."""
    if HAS_TRITON and not interpreter_active() and torch.cuda.is_available():
        return ["cuda"]
    return ["cpu"]


@pytest.fixture(params=kernel_devices())
def device(request: pytest.FixtureRequest) -> str:
    """The device the kernel tests run on (see kernel_devices)."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if request.param == "cpu" and not interpreter_active():
        pytest.fail("Triton was imported before TRITON_INTERPRET=1 was set: its kernels cannot "
                    "run on the CPU in this process; export TRITON_INTERPRET=1")
    return request.param

