"""Which build of the CPU kernels this machine runs: one variant per CPU class, chosen once
from the CPU's feature flags, overridable with `LOCALPAGED_CPU_ISA` (never above the CPU).

| variant      | compiled for                         | CPUs (examples)                       |
| ------------ | ------------------------------------ | ------------------------------------- |
| `generic`    | the plain C code, baseline flags     | any (aarch64: + NEON int8 dot product)|
| `avx2`       | AVX2 + FMA (`-march=haswell`)        | Intel Core since 2013, AMD Zen 1-3    |
| `avx2vnni`   | + AVX-VNNI (`-mavxvnni`)             | Intel Core 12th gen (Alder Lake) on   |
| `avx512`     | AVX-512F/BW/DQ/VL (skylake-avx512)   | Skylake-SP/X                          |
| `avx512vnni` | + AVX512-VNNI (`cascadelake`)        | Cascade Lake, Ice Lake, Tiger Lake    |
| `avx512bf16` | + AVX512-BF16, VNNI (`cooperlake`)   | AMD Zen 4/5, Intel Cooper Lake        |
| `amx`        | + AMX tiles (bf16, int8)             | Intel Sapphire Rapids and later       |

The VNNI variants matter where activations are float32 (every CPU without native bf16):
they round x to int8 per block and multiply with `vpdpbusd`, four products per int32 lane
(`int8_dot.c`), where plain AVX2 needs `vpmaddubsw` and a widening add.

Each variant is compiled with explicit flags (not `-march=native`), so a machine can build
and test every variant its CPU can execute.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

ISAS = ("generic", "avx2", "avx2vnni", "avx512", "avx512vnni", "avx512bf16", "amx")
ENV = "LOCALPAGED_CPU_ISA"

# The CPU flags (as /proc/cpuinfo names them) each variant's instructions need.
_AVX2 = ("avx", "avx2", "fma", "f16c", "bmi2")
_AVX512 = (*_AVX2, "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd")
_AVX512BF16 = (*_AVX512, "avx512_bf16", "avx512_vnni")
REQUIRED_FLAGS: dict[str, tuple[str, ...]] = {
    "generic": (),
    "avx2": _AVX2,
    "avx2vnni": (*_AVX2, "avx_vnni"),
    "avx512": _AVX512,
    "avx512vnni": (*_AVX512, "avx512_vnni"),
    "avx512bf16": _AVX512BF16,
    "amx": (*_AVX512BF16, "amx_tile", "amx_bf16", "amx_int8"),
}
_WIDE = ("-mprefer-vector-width=512",)  # GCC vectorizes 256 bits wide unless told otherwise
_X86_FLAGS: dict[str, tuple[str, ...]] = {
    "generic": ("-march=x86-64", "-mtune=generic"),
    "avx2": ("-march=haswell",),
    "avx2vnni": ("-march=haswell", "-mavxvnni"),
    "avx512": ("-march=skylake-avx512", *_WIDE),
    "avx512vnni": ("-march=cascadelake", *_WIDE),
    "avx512bf16": ("-march=cooperlake", *_WIDE),
    "amx": ("-march=cooperlake", "-mamx-tile", "-mamx-bf16", "-mamx-int8", *_WIDE),
}


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty where that cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def supported(flags: frozenset[str] | set[str] | None = None, x86: bool | None = None) -> list[str]:
    """The variants a CPU with `flags` can execute, slowest first."""
    return list(_supported(cpu_flags() if flags is None else frozenset(flags),
                           is_x86() if x86 is None else x86))


@functools.cache
def _supported(flags: frozenset[str], x86: bool) -> tuple[str, ...]:
    # cached: every kernel call asks (through `chosen`) which build to run
    if not x86:
        return ("generic",)
    return tuple(isa for isa in ISAS if all(f in flags for f in REQUIRED_FLAGS[isa]))


def best(flags: frozenset[str] | set[str] | None = None, x86: bool | None = None) -> str:
    """The fastest variant a CPU with `flags` can execute."""
    return supported(flags, x86)[-1]


def chosen() -> str:
    """The variant this process runs: `LOCALPAGED_CPU_ISA` if set, else the best one.

    Raises ValueError for an unknown name or a variant above what the CPU has."""
    want = os.environ.get(ENV, "").strip().lower()
    if not want or want == "auto":
        return best()
    if want not in ISAS:
        raise ValueError(f"{ENV}={want!r} is unknown: expected one of auto, {', '.join(ISAS)}")
    can = supported()
    if want not in can:
        missing = [f for f in REQUIRED_FLAGS[want] if f not in cpu_flags()]
        why = f"it lacks {', '.join(missing)}" if is_x86() else "it is not an x86 CPU"
        raise ValueError(f"{ENV}={want} needs instructions this CPU does not have ({why}); "
                         f"it can run: {', '.join(can)}")
    return want


def native_bf16(isa: str) -> bool:
    """Whether the variant multiplies bf16 numbers natively (else bf16 math is emulated)."""
    return isa in ("avx512bf16", "amx")


def compile_flags(isa: str) -> tuple[str, ...]:
    """The compiler's target flags for a variant."""
    if isa not in ISAS:
        raise ValueError(f"unknown CPU variant {isa!r}: expected one of {', '.join(ISAS)}")
    if is_x86():
        return _X86_FLAGS[isa]
    return ()  # aarch64 and others: the baseline target (NEON on aarch64)
