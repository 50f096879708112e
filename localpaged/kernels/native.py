"""Build and load the package's C kernels for the CPU (`localpaged/kernels/cpu/*.c`).

The library is compiled once per machine and CPU variant (`cpu_isa`: generic, avx2, avx512,
avx512bf16, amx; the best one the CPU has unless `LOCALPAGED_CPU_ISA` says otherwise) with the
system C compiler (`$CC`, else `cc`), cached under the user cache folder, and called through
ctypes. The compiled library links OpenMP by its usual name, `libgomp.so.1`, which torch has
loaded already: kernels run on torch's own thread pool, never beside a second one. A compiler
without OpenMP (Apple's clang) builds the same loops without it: one thread per call.

On ARM (aarch64 Linux, Apple silicon) only the `generic` variant exists: plain C built for the
compiler's baseline target (NEON on aarch64), no x86 flags. `scripts/check_arm.py` cross-builds
it and runs the kernels under qemu.

Without a compiler `load` returns None, after one line on stderr saying what is slower and what
to install; callers then use torch's ops, as they do with `LOCALPAGED_CPU_KERNELS=off`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from localpaged.kernels import cpu_isa

SOURCES = Path(__file__).parent / "cpu"
ALL = "all"  # the library of every kernel: cpu/all.c includes the others
OPENMP = "-fopenmp"  # dropped where the compiler has no OpenMP (see `build`)
FLAGS = ("-O3", OPENMP, "-shared", "-fPIC", "-std=c11")

_loaded: dict[tuple[str, str], ctypes.CDLL | None] = {}

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
# The C signatures of the library's entry points (see each kernel's source).
SIGNATURES: dict[str, tuple[list[type], type | None]] = {
    "w4_gemm_isa": ([], _I),
    "w4_gemm_bf16": ([_P] * 4 + [_I] * 5, _I),
    "w8_gemm_bf16": ([_P] * 4 + [_I] * 4, _I),
    "w4_gemm_f32": ([_P] * 4 + [_I] * 5, _I),
    "w8_gemm_f32": ([_P] * 4 + [_I] * 4, _I),
    "w4_gemm_f32_exact": ([_P] * 4 + [_I] * 5, _I),
    "w4_i8_gemm_f32": ([_P] * 4 + [_I] * 6, _I),
    "q8_gemm_f32": ([_P, _P, _P, _I, _P, _P] + [_I] * 6, _I),
    "q8_gemm_bf16": ([_P, _P, _P, _I, _P, _P] + [_I] * 5, _I),
    "w4q_gemm_f32": ([_P] * 4 + [_I] * 6, _I),
    "w4q_gemm_bf16": ([_P] * 4 + [_I] * 5, _I),
    "w6_gemm_f32": ([_P] * 4 + [_I, _P] + [_I] * 6, _I),
    "w6_gemm_bf16": ([_P] * 4 + [_I, _P] + [_I] * 5, _I),
    "gguf_w6_pack": ([_P, _I, _P, _I, _I, _P, _P, _P, _I, _I], _I),
    "gguf_q4k_pack_kq": ([_P, _I, _P, _I, _I, _P, _P, _P, _I], _I),
    "w4_bf16_quads": ([], _I),
    "w4_bf16_quads_amx_rows": ([], _I),
    "q8_amx_rows": ([], _I),
    "w4q_vector": ([], _I),
    "w6_vector": ([], _I),
    "w4_pairs_to_quads": ([_P, _P, _L, _I, _I], None),
    "w4_awq_to_internal": ([_P, _L, _L, _P, _I], None),
    "w4_gather_rows": ([_P, _P, _L, _L, _P, _I], None),
    "w4_internal_to_pairs": ([_P, _L, _L, _P, _I], None),
    "gguf_q4_pack": ([_P, _I, _P, _I, _I, _P, _P, _I, _I], _I),
    "gguf_q8_pack": ([_P, _I, _P, _I, _I, _P, _P, _I, _I], _I),
    "i8_dot_isa": ([], _I),
    "rows_to_int8": ([_P, _I, _I, _P, _P, _P, _I], None),
    "paged_decode_bf16": ([_P] * 4 + [_I, _P, _P] + [_I] * 5 + [_F, _I], _I),
    "decode_layer_bf16": ([_P] * 4 + [_I], _I),
    "decode_layers_bf16": ([_P, _P, _I, _P, _P], _I),
    "moe_rows_bf16": ([_P] * 4 + [_I, _P, _P] + [_I] * 4, _I),
    "moe_rows_f32": ([_P] * 4 + [_I, _P, _P] + [_I] * 4, _I),
    "paged_decode_f32": ([_P] * 4 + [_I, _P, _P] + [_I] * 5 + [_F, _I], _I),
    "paged_decode_f32h": ([_P] * 4 + [_I, _P, _P] + [_I] * 5 + [_F, _I], _I),
    "decode_layer_f32": ([_P] * 4 + [_I], _I),
    "decode_layers_f32": ([_P, _P, _I, _P, _P], _I),
    "rms_norm_rows_bf16": ([_P] * 5 + [_I] * 2 + [_F, _I], None),
    "silu_and_mul_rows_bf16": ([_P] * 2 + [_I] * 3, None),
    "rotary_rows_bf16": ([_P, _L, _I, _P, _L, _I, _I, _P, _I, _I], None),
    "rms_norm_rows_f32": ([_P] * 5 + [_I] * 2 + [_F, _I], None),
    "silu_and_mul_rows_f32": ([_P] * 2 + [_I] * 3, None),
    "rotary_rows_f32": ([_P, _L, _I, _P, _L, _I, _I, _P, _I, _I], None),
}


def cache_dir() -> Path:
    """Where compiled kernels are kept (`LOCALPAGED_KERNEL_CACHE` overrides)."""
    env = os.environ.get("LOCALPAGED_KERNEL_CACHE")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("localpaged")) / "cpu-kernels"


def enabled() -> bool:
    """False when `LOCALPAGED_CPU_KERNELS=off` asks for torch's ops only."""
    return os.environ.get("LOCALPAGED_CPU_KERNELS", "on").lower() not in ("off", "0", "no")


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _compiler_identity(cc: str) -> str:
    """The compiler's binary (symlinks followed), size and modification time: an upgrade
    changes them. Not `cc --version`: a process forked from one holding torch costs ~0.1 s of
    every model load."""
    real = os.path.realpath(cc)
    st = os.stat(real)
    return f"{real}|{st.st_size}|{st.st_mtime_ns}"


def has_compiler() -> bool:
    """Whether a C compiler is here to build the kernels (`$CC`, else `cc`)."""
    return _compiler() is not None


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else "no message"


def build(name: str, isa: str) -> Path:
    """Compile `cpu/<name>.c` for the CPU variant `isa` (if not cached) and return the
    library's path. Raises RuntimeError with the compiler's message if it cannot be built."""
    source = SOURCES / f"{name}.c"
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install one: `apt install gcc`)")
    flags = (*FLAGS, *cpu_isa.compile_flags(isa))
    version = _compiler_identity(cc)
    texts = [f.read_text() for f in sorted(SOURCES.iterdir()) if f.suffix in (".c", ".h")]
    key = hashlib.sha256(
        "\0".join([*texts, name, cc, version, *flags]).encode()
    ).hexdigest()[:16]  # every source: kernels include each other
    # One file per library and variant; a new source or compiler replaces the old file.
    target = cache_dir() / f"{name}-{isa}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes building at once never see half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, str(source), "-o", tmp], capture_output=True, text=True)
        if done.returncode != 0 and OPENMP in flags:
            # Apple's clang has no OpenMP (and a clang without libomp cannot link it): the
            # same loops run single-threaded per call. Kept under the same name, since the
            # same compiler gives the same answer next time.
            bare = [f for f in flags if f != OPENMP]
            again = subprocess.run([cc, *bare, str(source), "-o", tmp], capture_output=True,
                                   text=True)
            if again.returncode == 0:
                print(f"localpaged: {cc} cannot build with OpenMP, so each CPU kernel call "
                      f"runs on one thread ({_first_line(done.stderr)})", file=sys.stderr)
                done = again
        if done.returncode != 0:
            raise RuntimeError(f"{cc} could not compile {source.name}:\n{done.stderr.strip()}")
        os.replace(tmp, target)
        for stale in target.parent.glob(f"{name}-{isa}-*.so"):
            if stale != target:  # a loaded library stays usable after its file is removed
                stale.unlink(missing_ok=True)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(name: str, isa: str) -> ctypes.CDLL | None:
    """The compiled kernel library `name` for variant `isa`, or None when it cannot be built
    (said once on stderr). Callers check `enabled()` before choosing a kernel for a layer."""
    key = (name, isa)
    if key not in _loaded:
        lib = None
        try:
            import torch  # noqa: F401  (loads the libgomp the kernels must share)

            lib = ctypes.CDLL(str(build(name, isa)))
            for fn, (args, result) in SIGNATURES.items():
                if hasattr(lib, fn):
                    getattr(lib, fn).argtypes, getattr(lib, fn).restype = args, result
        except (RuntimeError, OSError) as e:
            print(f"localpaged: CPU kernel {name!r} unavailable, using torch's slower ops: {e}",
                  file=sys.stderr)
        _loaded[key] = lib
    return _loaded[key]


def library(isa: str | None = None) -> ctypes.CDLL | None:
    """The library of every kernel (`cpu/all.c`) for the variant `isa` (default: the one
    this process runs, `cpu_isa.chosen()`), or None when it cannot be built here."""
    return load(ALL, isa or cpu_isa.chosen())


def available() -> bool:
    """True when the kernels are wanted (`LOCALPAGED_CPU_KERNELS`), built and loaded here."""
    return enabled() and library() is not None
