"""Compile every Triton kernel for CUDA GPUs on a machine without one.

The interpreter checks what the kernels compute; this checks that they *compile* for real
targets (types, loop-carried values, dot shapes, register/shared-memory limits), through
Triton's own pipeline down to a cubin with the ptxas that ships in the triton wheel. It runs the
ordinary launchers on CPU tensors with each kernel's launch swapped for an ahead-of-time
compile of the same signature and constexprs.

    python -m localpaged.kernels.aot_check [--arch 90 --arch 80]

Triton fixes compiled-vs-interpreted mode at its import, so when this process imported it as
an interpreter, or not at all (a CUDA-less machine imports it only when asked), `main`
re-executes itself with TRITON_INTERPRET=0 and LOCALPAGED_KERNELS=triton.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from localpaged.kernels._triton import HAS_TRITON, interpreter_active

_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
          torch.int32: "i32", torch.int64: "i64"}

# Shared memory a block may use (opt-in maximum) per compute capability.
_SMEM_LIMITS = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


class _AotLaunch:
    """Stands in for a JITFunction: `kernel[grid](*args)` compiles instead of launching."""

    def __init__(self, fn: Any, archs: list[int], log: list[str]) -> None:
        self.fn, self.archs, self.log = fn, archs, log
        self.seen: set[str] = set()

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return self._compile

    def _compile(self, *args: Any, num_warps: int = 4, **kwargs: Any) -> None:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        bound = {**dict(zip(self.fn.arg_names, args)), **kwargs}
        sig: dict[str, str] = {}
        consts: dict[str, Any] = {}
        for p in self.fn.params:
            v = bound[p.name]
            if p.is_constexpr:
                sig[p.name], consts[p.name] = "constexpr", v
            elif isinstance(v, torch.Tensor):
                sig[p.name] = "*" + _TYPES[v.dtype]
            elif isinstance(v, bool):
                sig[p.name] = "i1"
            elif isinstance(v, int):
                sig[p.name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            else:
                sig[p.name] = "fp32"
        key = f"{sorted(sig.items())}{sorted(consts.items())}{num_warps}"
        if key in self.seen:
            return
        self.seen.add(key)
        for arch in self.archs:
            t = time.perf_counter()
            kernel = triton.compile(ASTSource(self.fn, sig, consts),
                                    target=GPUTarget("cuda", arch, 32),
                                    options={"num_warps": num_warps})
            smem = kernel.metadata.shared
            limit = _SMEM_LIMITS.get(arch, 99 * 1024)
            if smem > limit:
                raise RuntimeError(f"{self.fn.__name__} {_short(consts)} needs {smem} bytes of "
                                   f"shared memory; sm_{arch} has {limit}")
            self.log.append(f"sm_{arch} {self.fn.__name__:<21} {_short(consts):<66} "
                            f"smem {smem:>6} {time.perf_counter() - t:.1f}s")


def _short(consts: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in consts.items() if k not in ("DOT_PREC",))


def run(archs: list[int], quick: bool = False) -> list[str]:
    """Compile the kernels for representative shapes/dtypes; returns one log line per cubin."""
    from localpaged.kernels.testing import make_paged_batch

    # The op modules (the package re-exports functions under some of the same names).
    activation, attention_decode, attention_prefill, kv_write, rms_norm, rotary = (
        importlib.import_module(f"localpaged.kernels.{name}") for name in (
            "activation", "attention_decode", "attention_prefill", "kv_write", "rms_norm",
            "rotary"))

    log: list[str] = []
    kernels = [(kv_write, "_write_kv_kernel"), (rms_norm, "_rms_norm_kernel"),
               (rotary, "_rotary_kernel"), (activation, "_silu_and_mul_kernel"),
               (attention_decode, "_decode_kernel"), (attention_decode, "_reduce_kernel"),
               (attention_prefill, "_prefill_kernel")]
    saved = {(m, n): getattr(m, n) for m, n in kernels}
    try:
        for m, n in kernels:
            setattr(m, n, _AotLaunch(getattr(m, n), archs, log))
        dtypes = [torch.float16] if quick else [torch.float16, torch.bfloat16, torch.float32]
        shapes = [(8, 1, 128)] if quick else [(32, 8, 128), (9, 3, 64), (8, 8, 80), (8, 1, 256)]
        for dtype, (hq, hkv, d) in itertools.product(dtypes, shapes):
            q, kc, vc, meta = make_paged_batch([1, 1], [5, 300], hq, hkv, d, 16, dtype)
            attention_decode.paged_decode_attention(q, kc, vc, meta, 0.1, num_splits=1)
            attention_decode.paged_decode_attention(q, kc, vc, meta, 0.1, num_splits=2)
            q, kc, vc, meta = make_paged_batch([3, 1], [9, 40], hq, hkv, d, 16, dtype)
            attention_prefill.paged_prefill_attention(q, kc, vc, meta, 0.1)
            k = torch.zeros(2, hkv, d, dtype=dtype)
            kv_write.write_kv_triton(k, k, kc, vc, torch.zeros(2, dtype=torch.long))
            rotary.apply_rotary_triton(torch.zeros(2, hq, d, dtype=dtype), k,
                                       torch.zeros(2, dtype=torch.long), torch.zeros(4, d))
        for dtype, hidden in itertools.product(dtypes, [576, 4096]):
            x = torch.zeros(2, hidden, dtype=dtype)
            rms_norm.rms_norm_triton(x, torch.ones(hidden, dtype=dtype), 1e-6, x)
            rms_norm.rms_norm_triton(x, torch.ones(hidden), 1e-6)
            activation.silu_and_mul_triton(torch.zeros(2, 2 * hidden, dtype=dtype))
    finally:
        for (m, n), fn in saved.items():
            setattr(m, n, fn)
    return log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, action="append",
                    help="compute capability, e.g. 90 (default: 90, 89 and 80)")
    ap.add_argument("--quick", action="store_true", help="one dtype and shape per kernel")
    args = ap.parse_args()
    if interpreter_active() or not HAS_TRITON:
        if os.environ.get("_LOCALPAGED_AOT_CHILD") == "1":
            sys.exit("aot_check needs Triton: pip install triton")
        env = {**os.environ, "TRITON_INTERPRET": "0", "LOCALPAGED_KERNELS": "triton",
               "_LOCALPAGED_AOT_CHILD": "1"}
        os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *sys.argv[1:]], env)
    for line in run(args.arch or [90, 89, 80], args.quick):
        print(line)


if __name__ == "__main__":
    main()
