"""What a benchmark prints about the CPU, and how it makes torch compute like another CPU class.

A forced kernel variant (`LOCALPAGED_CPU_ISA`) only changes the package's own kernels; torch's
ops would still use everything this CPU has (oneDNN's AMX or AVX512-BF16 matmuls, ATen's
AVX-512 loops, MKL's AVX-512 sgemm: a float32 Linear at 338 GFLOP/s here, 200 held to AVX2).
`torch_env(isa)` holds them to the same class, so a run of the avx2 variant on
a bigger machine computes what an AVX2 machine would (its speed still differs: cache, clocks).
"""

from __future__ import annotations

import platform

from localpaged.kernels import cpu_isa

_TORCH_CLASS = {  # ATen's vector loops, oneDNN's kernels and MKL's (sgemm: Linear, attention)
    "generic": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx2vnni": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI",
                 "MKL_ENABLE_INSTRUCTIONS": "AVX2_E1"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx512vnni": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
                   "MKL_ENABLE_INSTRUCTIONS": "AVX512_E1"},
    "avx512bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
                   "MKL_ENABLE_INSTRUCTIONS": "AVX512_E3"},
    "amx": {},
}


def torch_env(isa: str) -> dict[str, str]:
    """Environment variables that keep torch's CPU kernels to the class of variant `isa`."""
    return dict(_TORCH_CLASS[isa])


def describe_cpu() -> str:
    """The CPU's model, its vector flags and the variants it can run, for a benchmark's header."""
    model = "?"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                         platform.processor() or "?")
    except OSError:
        pass
    vector = sorted(f for f in cpu_isa.cpu_flags()
                    if f.startswith(("avx", "amx", "fma", "f16c", "asimd", "sve")))
    return (f"CPU: {model} | flags: {' '.join(vector) or '-'}\n"
            f"kernel variants this CPU runs: {', '.join(cpu_isa.supported())} "
            f"(default: {cpu_isa.best()})")


def memory_bandwidth_gbs(mib: int = 512, repeats: int = 5) -> float:
    """The machine's read+write bandwidth, GB/s: the best of `repeats` STREAM-style triads
    (a = b + 2 c) on float32 arrays of `mib` MiB each, on torch's threads (3 arrays moved:
    2 read, 1 written)."""
    import time

    import torch

    n = mib * 2**20 // 4
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.add(b, c, alpha=2.0, out=a)
        best = min(best, time.perf_counter() - start)
    return 3 * n * 4 / best / 1e9
