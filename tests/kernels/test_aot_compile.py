"""The Triton kernels compile for a real CUDA target (sm_90), no GPU needed: catches what the
interpreter cannot (compiled-mode typing, dot shapes, shared memory). The full matrix of
dtypes, head dims and archs: `python -m localpaged.kernels.aot_check` (~5 min on 2 cores)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from localpaged.kernels._triton import HAS_TRITON


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON or sys.platform != "linux", reason="needs triton's ptxas")
def test_kernels_compile_for_sm90() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "localpaged.kernels.aot_check", "--quick", "--arch", "90"],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    compiled = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("sm_90")}
    assert compiled == {"_write_kv_kernel", "_rms_norm_kernel", "_rotary_kernel",
                        "_silu_and_mul_kernel", "_decode_kernel", "_reduce_kernel",
                        "_prefill_kernel"}
