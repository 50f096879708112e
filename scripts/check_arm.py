"""Cross-build the CPU kernels for aarch64 and run them under qemu-user against this x86
machine's plain-C build (`generic`) and torch.

    apt-get install gcc-aarch64-linux-gnu qemu-user   # clang too, for the clang builds
    python scripts/check_arm.py [--builds gcc,gcc-noomp,clang,clang-noomp,...]

Each build compiles `localpaged/kernels/cpu/all.c` as `native.build` does on an ARM host (the
same flags, no x86 ones), links `scripts/arm/kernel_check.c` against it and runs that driver
under `qemu-aarch64` on inputs packed here by the Python wrappers (`localpaged.quant.cpu_w4`
and the decode-layer structs). Every entry point is called; the results must be

* bit-exact against the x86 generic build where the arithmetic is integers then one float
  per block (the int8-activation paths: `w4_i8_gemm_f32`, `q8_gemm_f32`), for the builds
  that round floats as it does (GCC; clang with -ffp-contract=off), and for every build
  on the NEON code (`plain=0`; intrinsics are not fused);
* within float32 rounding (bf16: one bf16 step) elsewhere: clang fuses multiply-adds, and
  `omp simd` reductions may sum in another order without OpenMP. (Measured: the GCC OpenMP
  build is bit-exact on every entry point.)
* and within each kernel's documented tolerance of a float64 torch reference.

Not part of the default test run (a few minutes of cross-compiling); `tests/kernels/
test_arm_qemu.py` runs it when `LOCALPAGED_ARM_CHECK=1` and the tools are here.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from localpaged.kernels import cpu_isa, native  # noqa: E402
from localpaged.kernels import decode_layer as dl  # noqa: E402
from localpaged.quant import cpu_w4  # noqa: E402
from localpaged.quant.layout import from_codes  # noqa: E402

DRIVER = ROOT / "scripts" / "arm" / "kernel_check.c"
SYSROOT = "/usr/aarch64-linux-gnu"
THREADS = 2
# The builds: the compiler's command, whether OpenMP is on, and whether it rounds floats as
# the x86 generic build (GCC in ISO C mode does not fuse multiply-adds; clang fuses `a * b + c`
# within an expression, -ffp-contract=on, unless told not to).
BUILDS: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    "gcc": (("aarch64-linux-gnu-gcc",), True, True),
    "gcc-noomp": (("aarch64-linux-gnu-gcc",), False, True),
    "clang": (("clang", "--target=aarch64-linux-gnu"), True, False),
    "clang-noomp": (("clang", "--target=aarch64-linux-gnu"), False, False),
    "clang-nofma": (("clang", "--target=aarch64-linux-gnu", "-ffp-contract=off"), False, True),
    # Armv8.2 dot products (`sdot`), as Apple's clang targets by default
    "gcc-dotprod": (("aarch64-linux-gnu-gcc", "-march=armv8.2-a+dotprod"), True, True),
    "clang-dotprod": (("clang", "--target=aarch64-linux-gnu", "-march=armv8.2-a+dotprod"), False,
                      False),
}


@dataclass
class Struct:
    """A ctypes struct argument whose pointer fields (dotted paths) point at tensors."""

    value: ctypes.Structure
    refs: dict[str, torch.Tensor | None]


Arg = torch.Tensor | Struct | int | float | None


@dataclass
class Call:
    """One call of an entry point; `outputs` are the tensors it writes (compared after)."""

    label: str
    fn: str
    args: list[Arg]
    outputs: list[torch.Tensor]
    exact: bool = False  # bit-exact against the x86 generic build expected
    reference: list[torch.Tensor] | None = None  # float64 torch results, or None
    tolerance: float = 0.0  # of the largest reference value
    int8_reference: list[torch.Tensor] | None = None  # what builds with int8 activations give
    vector: bool = False  # the int8 vector code on NEON: bit-exact on every build (intrinsics
    # are never fused, where the plain C's `a * b + c` is by clang)
    results: dict[str, list[torch.Tensor]] = field(default_factory=dict)


def _field_offset(cls: type[ctypes.Structure], path: str) -> int:
    offset = 0
    for part in path.split("."):
        offset += getattr(cls, part).offset
        cls = dict(cls._fields_)[part]
    return offset


def _set_field(value: ctypes.Structure, path: str, pointer: int | None) -> None:
    *outer, last = path.split(".")
    setattr(functools.reduce(getattr, outer, value), last, pointer)


def run_ctypes(lib: ctypes.CDLL, call: Call) -> list[torch.Tensor]:
    """The call on a library loaded here (on copies of the tensors); returns the outputs."""
    copies: dict[int, torch.Tensor] = {}

    def copy(t: torch.Tensor) -> torch.Tensor:
        return copies.setdefault(id(t), t.clone())

    args: list[int | float | None] = []
    keep = []
    for a in call.args:
        if isinstance(a, torch.Tensor):
            args.append(copy(a).data_ptr())
        elif isinstance(a, Struct):
            value = type(a.value).from_buffer_copy(bytes(a.value))
            for path, t in a.refs.items():
                _set_field(value, path, copy(t).data_ptr() if t is not None else None)
            keep.append(value)
            args.append(ctypes.addressof(value))
        else:
            args.append(a)
    rc = getattr(lib, call.fn)(*args)
    if rc:
        raise RuntimeError(f"{call.label}: {call.fn} returned {rc}")
    return [copies[id(t)] for t in call.outputs]


def run_qemu(driver: Path, calls: list[Call], work: Path, probe: bool = False) -> Any:
    """Every call through the aarch64 driver under qemu, in one process; returns the outputs
    (`probe`: the one call's result instead)."""
    lines: list[str] = []
    names: dict[int, str] = {}

    def tensor(t: torch.Tensor, prefix: str) -> str:
        if id(t) not in names:
            name = f"{prefix}t{len(names)}"
            path = work / f"{name}.bin"
            path.write_bytes(t.contiguous().view(torch.uint8).numpy().tobytes())
            lines.append(f"load {name} {path}")
            names[id(t)] = name
        return names[id(t)]

    kinds = {ctypes.c_void_p: "p", ctypes.c_int: "i", ctypes.c_long: "l", ctypes.c_float: "f"}
    for c, call in enumerate(calls):
        names.clear()  # each call on its own copies
        words = []
        for i, (a, kind) in enumerate(zip(call.args, native.SIGNATURES[call.fn][0], strict=True)):
            if isinstance(a, torch.Tensor):
                words.append(f"p:{tensor(a, f'c{c}')}")
            elif isinstance(a, Struct):
                name = f"c{c}s{i}"
                path = work / f"{name}.bin"
                path.write_bytes(bytes(a.value))
                lines.append(f"load {name} {path}")
                for ref, t in a.refs.items():
                    target = tensor(t, f"c{c}") if t is not None else "-"
                    lines.append(f"ptr {name} {_field_offset(type(a.value), ref)} {target}")
                words.append(f"p:{name}")
            elif a is None:
                words.append("p:-")
            elif kinds[kind] == "f":
                words.append(f"f:{torch.tensor(float(a)).item().hex()}")
            else:
                words.append(f"{kinds[kind]}:{int(a)}")
        lines.append(f"call {call.fn} {' '.join(words)}")
        for j, t in enumerate(call.outputs):
            lines.append(f"save {names[id(t)]} {work / f'c{c}_out{j}.bin'}")
    script = work / "calls.txt"
    script.write_text("\n".join(lines) + "\n")
    done = subprocess.run(["qemu-aarch64", "-L", SYSROOT, str(driver), str(script)],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the driver failed ({done.returncode}):\n{done.stderr}")
    if probe:
        return int(done.stdout.split(" -> ")[1])
    for line, call in zip(done.stdout.splitlines(), calls, strict=True):
        fn, rc = line.split(" -> ")
        if fn != call.fn or int(rc) != 0:
            raise RuntimeError(f"{call.label}: {line}")
    results = []
    for c, call in enumerate(calls):
        outs = []
        for j, t in enumerate(call.outputs):
            data = bytearray((work / f"c{c}_out{j}.bin").read_bytes())
            outs.append(torch.frombuffer(data, dtype=torch.uint8).view(t.dtype).view(t.shape))
        results.append(outs)
    return results


def build(name: str, work: Path) -> tuple[Path | None, str]:
    """(the driver linked against build `name`'s library, or None when it only compiled,
    and a line saying what was built)."""
    cc, openmp, _ = BUILDS[name]
    flags = [f for f in native.FLAGS if openmp or f != native.OPENMP]
    out = work / name
    out.mkdir()
    lib = out / "libkernels.so"
    source = native.SOURCES / f"{native.ALL}.c"
    done = subprocess.run([*cc, *flags, str(source), "-o", str(lib)], capture_output=True,
                          text=True)
    if done.returncode != 0 and openmp:
        # clang's OpenMP runtime (libomp) has no aarch64 build here: compile, do not run
        obj = subprocess.run([*cc, *flags, "-c", str(source), "-o", str(out / "all.o")],
                             capture_output=True, text=True)
        if obj.returncode == 0:
            lines = done.stderr.splitlines()
            why = [x for x in lines if "omp" in x] or [x for x in lines if "error" in x] or ["?"]
            return None, f"{name}: compiled, not run (cannot link: {why[0].strip()})"
    if done.returncode != 0:
        raise RuntimeError(f"{name}: {' '.join(cc)} could not build the library:\n{done.stderr}")
    driver = out / "kernel_check"
    subprocess.run([*cc, "-O2", "-std=c11", str(DRIVER), str(lib), f"-Wl,-rpath,{out}",
                    "-lm", "-o", str(driver)], check=True)  # libm: Python has it loaded
    return driver, f"{name}: built and run ({' '.join([*cc, *flags])})"


# ---- the calls --------------------------------------------------------------------------


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _w4(k: int, n: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    codes = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    scales = torch.rand(k // group, n, generator=g) * 0.02 + 0.005
    zeros = torch.rand(k // group, n, generator=g) * 15
    return cpu_w4.pack(from_codes(codes, scales, zeros, group))


def _int8_reference(x: torch.Tensor, w: torch.Tensor, block: int) -> torch.Tensor:
    """x @ w.T with x rounded to int8 per block, as the int8-activation kernels define it."""
    xq, dx = cpu_w4.quantize_activations(x.float(), block)
    rounded = (xq.double().reshape(*dx.shape, block) * dx.double()[..., None]).reshape(x.shape)
    return rounded @ w.double().t()


def gemm_calls() -> list[Call]:
    """4-bit (float32 exact, int8 plain and vector, bf16), per-channel int8, int8 blocks."""
    calls = []
    # odd pairs per group or block (6 values of K) leave `sdot` a half step at the end
    for rows, (k, n, group) in [(1, (256, 64, 64)), (5, (128, 48, 32)), (9, (256, 32, 128)),
                                (3, (96, 16, 6))]:
        packed, sb = _w4(k, n, group, rows)
        w = cpu_w4.dequantize(packed, sb)
        x = torch.randn(rows, k, generator=_gen(k + rows))
        f32 = x.double() @ w.double().t()
        i8 = _int8_reference(x, w, group)
        tag = f"{rows}x{k}x{n}/g{group}"
        for fn in ("w4_gemm_f32", "w4_gemm_f32_exact"):
            y = torch.zeros(rows, n)
            calls.append(Call(f"{fn} {tag}", fn, [x, packed, sb, y, rows, k, n, group, THREADS],
                              [y], exact=fn == "w4_gemm_f32", reference=[f32], tolerance=2**-18,
                              int8_reference=[i8] if fn == "w4_gemm_f32" else None,
                              vector=fn == "w4_gemm_f32"))
        for plain in (1, 0):
            y = torch.zeros(rows, n)
            calls.append(Call(f"w4_i8_gemm_f32 plain={plain} {tag}", "w4_i8_gemm_f32",
                              [x, packed, sb, y, rows, k, n, group, THREADS, plain], [y],
                              exact=True, reference=[i8], tolerance=2**-18, vector=not plain))
        xb = x.bfloat16()
        y = torch.zeros(rows, n, dtype=torch.bfloat16)
        calls.append(Call(f"w4_gemm_bf16 {tag}", "w4_gemm_bf16",
                          [xb, packed, sb, y, rows, k, n, group, THREADS], [y],
                          reference=[xb.double() @ w.double().t()], tolerance=2**-6))
        codes = torch.randint(-127, 128, (n, k), generator=_gen(rows), dtype=torch.int8)
        scale = torch.rand(n, generator=_gen(rows + 1)) * 0.01
        tiles = cpu_w4.pack_w8(codes)
        w8 = codes.double() * scale.double()[:, None]
        for dtype, fn, tol in ((torch.float32, "w8_gemm_f32", 2**-18),
                               (torch.bfloat16, "w8_gemm_bf16", 2**-6)):
            xx = x.to(dtype)
            y = torch.zeros(rows, n, dtype=dtype)
            calls.append(Call(f"{fn} {tag}", fn, [xx, tiles, scale, y, rows, k, n, THREADS], [y],
                              reference=[xx.double() @ w8.t()], tolerance=tol))
        block = cpu_w4.Q8_BLOCK if group >= cpu_w4.Q8_BLOCK else group
        bscales = torch.rand(n, k // block, generator=_gen(rows + 2)) * 0.01
        offsets = torch.randn(n, k // block, generator=_gen(rows + 3)) * 0.01
        for with_offsets in (False, True):
            t, ts, to = cpu_w4.pack_q8(codes, bscales, offsets if with_offsets else None)
            wq = cpu_w4.dequantize_q8(t, ts, to)
            for plain in (1, 0):
                y = torch.zeros(rows, n)
                calls.append(Call(
                    f"q8_gemm_f32 offsets={int(with_offsets)} plain={plain} {tag}", "q8_gemm_f32",
                    [x, t, ts, int(ts.dtype == torch.float16), to, y, rows, k, n, block, THREADS,
                     plain], [y], exact=True,
                    reference=[_int8_reference(x, wq, block)], tolerance=2**-18,
                    vector=not plain))
    return calls


def w6_calls() -> list[Call]:
    """The quads layout's every form through `w6_gemm` (quant/cpu_w6.py): 6-bit codes with
    offsets, 6-bit and 4-bit symmetric groups, Q4_K's super-block scales and IQ4_NL's code
    book, plain and vector, float32 (against the x86 int8 build, bit for bit) and bf16."""
    from localpaged.quant import cpu_w6

    calls = []
    for rows, (n, k, group), (six, zp) in [(1, (32, 256, 32), (True, 0)),
                                           (5, (48, 96, 16), (True, 32)),
                                           (3, (32, 160, 32), (False, 8)),
                                           (9, (32, 512, 32), (False, cpu_w6.KQ)),
                                           (5, (32, 512, 32), (True, cpu_w6.KQ)),
                                           (4, (48, 96, 12), (False, cpu_w6.NL)),
                                           (2, (32, 2048, 256), (True, 0))]:
        g = _gen(rows + k)
        codes = torch.randint(0, 64 if six else 16, (n, k), generator=g, dtype=torch.uint8)
        codes[:, : k // 2] = 63 if six else 15  # the int16 sums' largest
        if zp == cpu_w6.KQ:
            d, dmin = (torch.rand(n, k // 256, generator=g) * 1e-3 for _ in range(2))
            sc, mins = (torch.randint(0, 64, (n, k // 32), generator=g) for _ in range(2))
            packed, high, sb = cpu_w6.pack_kq(codes, d, dmin, sc, mins, top_bits=six)
        else:
            scales = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
            offsets = None if zp else -32 * scales + torch.randn(n, k // group, generator=g) * 1e-3
            packed, high, sb = cpu_w6.pack(codes, scales, offsets, zero_point=zp, top_bits=six)
        w = cpu_w6.dequantize(packed, high, sb, zp)
        x = torch.randn(rows, k, generator=g)
        x[0, : k // 2] = x[0, : k // 2].abs() * 10  # one sign at the largest codes
        gs = cpu_w6.group_size(packed, sb, zp)
        block = cpu_w6.activation_block(zp, gs, k, six)  # per super-block for KQ (and 256s)
        ref = _int8_reference(x, w, block)
        tag = f"{rows}x{k}x{n}/g{gs} zp={zp}{' 6-bit' if six else ''}"
        for plain in (1, 0):
            y = torch.zeros(rows, n)
            calls.append(Call(f"w6_gemm_f32 plain={plain} {tag}", "w6_gemm_f32",
                              [x, packed, high, sb, zp, y, rows, k, n, gs, THREADS, plain], [y],
                              exact=True, reference=[ref], tolerance=2**-18, vector=not plain))
        xb = x.bfloat16()
        y = torch.zeros(rows, n, dtype=torch.bfloat16)
        calls.append(Call(f"w6_gemm_bf16 {tag}", "w6_gemm_bf16",
                          [xb, packed, high, sb, zp, y, rows, k, n, gs, THREADS], [y],
                          reference=[_int8_reference(xb.float(), w, block)], tolerance=2**-7))
    return calls


def _attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         tables: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float64)
    rep = q.shape[1] // k_cache.shape[2]
    for b, n in enumerate(lens.tolist()):
        blocks = tables[b, : (n + k_cache.shape[1] - 1) // k_cache.shape[1]].long()
        keys = k_cache[blocks].flatten(0, 1)[:n].double().repeat_interleave(rep, dim=1)
        values = v_cache[blocks].flatten(0, 1)[:n].double().repeat_interleave(rep, dim=1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[b].double() * scale, keys), dim=-1)
        out[b] = torch.einsum("ht,thd->hd", p, values)
    return out


def decode_calls() -> list[Call]:
    """Paged decode attention, per (query, cache) dtype: float32 over float16 is a float32
    model's cache."""
    calls = []
    batch, heads, kv_heads, dim, block = 3, 4, 2, 64, 16
    lens = torch.tensor([1, 17, 40], dtype=torch.int32)
    tables = torch.tensor([[5, 0, 0], [2, 7, 0], [1, 3, 6]], dtype=torch.int32)
    g = _gen(7)
    for dtype, cache, suffix, tol in ((torch.float32, torch.float32, "f32", 2**-18),
                                      (torch.bfloat16, torch.bfloat16, "bf16", 2**-7),
                                      (torch.float32, torch.float16, "f32h", 2**-18)):
        q = torch.randn(batch, heads, dim, generator=g).to(dtype)
        kc = torch.randn(8, block, kv_heads, dim, generator=g).to(cache)
        vc = torch.randn(8, block, kv_heads, dim, generator=g).to(cache)
        out = torch.zeros(batch, heads, dim, dtype=dtype)
        scale = dim**-0.5
        calls.append(Call(f"paged_decode_{suffix}", f"paged_decode_{suffix}",
                          [q, kc, vc, tables, tables.shape[1], lens, out, batch, heads, kv_heads,
                           dim, block, scale, THREADS], [out],
                          reference=[_attention_reference(q, kc, vc, tables, lens, scale)],
                          tolerance=tol))
    return calls


def elementwise_calls() -> list[Call]:
    """RMSNorm (with and without a residual), SiLU-and-mul and rotary rows, per dtype."""
    calls = []
    rows, dim, inter, heads, kv_heads, hd = 6, 96, 80, 4, 2, 16
    g = _gen(11)
    for dtype, suffix, tol in ((torch.float32, "f32", 2**-20), (torch.bfloat16, "bf16", 2**-7)):
        x = torch.randn(rows, dim, generator=g).to(dtype)
        res = torch.randn(rows, dim, generator=g).to(dtype)
        weight = (1 + 0.1 * torch.randn(dim, generator=g)).to(dtype)
        for r in (None, res):
            out, res_out = torch.zeros_like(x), torch.zeros_like(x)
            s = x.double() + (r.double() if r is not None else 0)
            ref = weight.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)
            calls.append(Call(f"rms_norm_rows_{suffix} residual={r is not None}",
                              f"rms_norm_rows_{suffix}",
                              [x, r, res_out, weight, out, rows, dim, 1e-5, THREADS],
                              [out, res_out], reference=[ref, s], tolerance=tol * 4))
        gu = torch.randn(rows, 2 * inter, generator=g).to(dtype)
        out = torch.zeros(rows, inter, dtype=dtype)
        gate, up = gu.double().chunk(2, dim=-1)
        calls.append(Call(f"silu_and_mul_rows_{suffix}", f"silu_and_mul_rows_{suffix}",
                          [gu, out, rows, inter, THREADS], [out],
                          reference=[torch.nn.functional.silu(gate) * up], tolerance=tol * 4))
        q = torch.randn(rows, heads * hd, generator=g).to(dtype)
        k = torch.randn(rows, kv_heads * hd, generator=g).to(dtype)
        angles = torch.rand(rows, hd // 2, generator=g) * 6
        cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).float().contiguous()
        refs = [_rotate(t.double().view(rows, -1, hd), cos_sin).reshape(rows, -1) for t in (q, k)]
        calls.append(Call(f"rotary_rows_{suffix}", f"rotary_rows_{suffix}",
                          [q, q.stride(0), heads, k, k.stride(0), kv_heads, hd, cos_sin, rows,
                           THREADS], [q, k], reference=refs, tolerance=tol * 4))
    return calls


def _rotate(v: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    half = v.shape[-1] // 2
    c, s = cos_sin.double()[:, None, :half], cos_sin.double()[:, None, half:]
    a, b = v[..., :half], v[..., half:]
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1)


def layer_calls() -> list[Call]:
    """One decoder layer per dtype (in float32 also with int8 blocks for the MLP's down, and
    over a float16 cache, a float32 model's)."""
    calls = []
    hidden, heads, kv_heads, hd, inter, group, block = 64, 4, 2, 16, 96, 32, 16
    batch, lens = 2, torch.tensor([3, 20], dtype=torch.int32)
    tables = torch.tensor([[4, 0], [1, 2]], dtype=torch.int32)
    slots = (tables.gather(1, ((lens - 1) // block).long()[:, None])[:, 0].long() * block
             + (lens - 1).long() % block)
    shapes = {"qkv": (hidden, (heads + 2 * kv_heads) * hd), "o": (heads * hd, hidden),
              "gate_up": (hidden, 2 * inter), "down": (inter, hidden)}
    for dtype, suffix, q8_down, cache in ((torch.float32, "f32", False, torch.float32),
                                          (torch.float32, "f32", True, torch.float32),
                                          (torch.float32, "f32", False, torch.float16),
                                          (torch.bfloat16, "bf16", False, torch.bfloat16)):
        g = _gen(13)
        refs: dict[str, torch.Tensor | None] = {}
        views = {}
        for i, (name, (k, n)) in enumerate(shapes.items()):
            if name == "down" and q8_down:
                codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
                t, ts, to = cpu_w4.pack_q8(codes, torch.rand(n, k // 32, generator=g) * 0.01,
                                           torch.randn(n, k // 32, generator=g) * 0.01)
                views[name] = dl._W4(None, None, None, k, n, 0, None, None, None, 32)
                refs.update({f"{name}.codes8": t, f"{name}.scales8": ts, f"{name}.offsets8": to})
                continue
            packed, sb = _w4(k, n, group, 100 + i)
            bias = torch.randn(n, generator=g).to(dtype) * 0.1 if name == "qkv" else None
            views[name] = dl._W4(None, None, None, k, n, group)
            refs.update({f"{name}.packed": packed, f"{name}.sb": sb, f"{name}.bias": bias})
        norms = [(1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype) for _ in range(2)]
        kc = (torch.randn(5, block, kv_heads, hd, generator=g) * 0.5).to(cache)
        vc = torch.randn(5, block, kv_heads, hd, generator=g).to(cache)
        refs.update({"input_norm": norms[0], "post_norm": norms[1], "k_cache": kc,
                     "v_cache": vc})
        layer = dl._Layer(None, None, views["qkv"], views["o"], views["gate_up"], views["down"],
                          None, None)
        angles = torch.rand(batch, hd // 2, generator=g) * 6
        cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).float().contiguous()
        step = dl._Step(batch=batch, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=hd,
                        intermediate=inter, block_size=block, table_stride=tables.shape[1],
                        threads=THREADS, eps=1e-5, scale=hd**-0.5,
                        kv_half=int(cache == torch.float16))
        x = torch.randn(batch, hidden, generator=g).to(dtype)
        residual = torch.zeros_like(x)
        calls.append(Call(
            f"decode_layer_{suffix}{' q8 down' if q8_down else ''}"
            f"{' float16 cache' if cache != dtype else ''}", f"decode_layer_{suffix}",
            [Struct(step, {"slots": slots, "tables": tables, "seq_lens": lens,
                           "cos_sin": cos_sin}), Struct(layer, refs), x, residual, 1],
            [x, residual, kc, vc]))
    return calls


def all_calls() -> list[Call]:
    return [*gemm_calls(), *w6_calls(), *decode_calls(), *elementwise_calls(), *layer_calls()]


# ---- comparing ----------------------------------------------------------------------------


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.double().abs().max().item() or 1.0
    return (a.double() - b.double()).abs().max().item() / scale


def _step(t: torch.Tensor) -> float:
    """Rounding allowed between two builds: float32's few last bits, one bf16 step."""
    return 2**-7 if t.dtype == torch.bfloat16 else 2**-20


def compare(calls: list[Call], builds: dict[str, bool], log: Callable[[str], None]) -> list[str]:
    """Lines describing each failure (empty: all held). `builds`: the aarch64 builds run, and
    whether each takes float32 activations as int8 (then held to the x86 int8 build)."""
    failures = []
    for call in calls:
        line = [f"{call.label:45s}"]
        for x86, int8 in (("x86", False), ("x86-int8", True)):
            reference = (call.int8_reference or call.reference) if int8 else call.reference
            if reference is None or x86 not in call.results:
                continue
            got = call.results[x86]
            err = max(_rel(a, r) for a, r in zip(got, reference, strict=True))
            line.append(f"{x86}-vs-torch {err:.1e}")
            if err > call.tolerance:
                failures.append(f"{call.label}: {x86} {err:.2e} from torch > {call.tolerance:.1e}")
        for name, int8 in builds.items():
            got = call.results[name]
            x86 = call.results["x86-int8" if int8 else "x86"]
            reference = (call.int8_reference or call.reference) if int8 else call.reference
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                       for a, b in zip(got, x86, strict=True))
            err = max(_rel(a, b) for a, b in zip(got, x86, strict=True))
            line.append(f"{name} {'bit-exact' if same else f'{err:.1e}'}")
            if call.exact and (BUILDS[name][2] or (call.vector and int8)) and not same:
                failures.append(f"{call.label}: {name} not bit-exact with x86 ({err:.2e})")
            elif err > max(_step(t) for t in got) * 4:
                failures.append(f"{call.label}: {name} {err:.2e} from x86")
            if reference is not None:
                ref_err = max(_rel(a, r) for a, r in zip(got, reference, strict=True))
                if ref_err > call.tolerance:
                    failures.append(f"{call.label}: {name} {ref_err:.2e} from torch")
        log("  ".join(line))
    return failures


def tools(builds: list[str]) -> list[str]:
    """The tools these builds need that are not here."""
    need = {"qemu-aarch64"} | {BUILDS[b][0][0] for b in builds}
    if any(BUILDS[b][0][0] == "clang" for b in builds):
        need.add("aarch64-linux-gnu-gcc")  # clang links against gcc's aarch64 sysroot
    missing = sorted(t for t in need if shutil.which(t) is None)
    if not missing and any(BUILDS[b][0][0] == "clang" and BUILDS[b][1] for b in builds) \
            and not _clang_has_aarch64_openmp():
        missing.append("omp.h for clang's aarch64 target (libomp-dev:arm64)")
    return missing


@functools.cache
def _clang_has_aarch64_openmp() -> bool:
    """Whether clang finds an OpenMP header for aarch64 (Debian's clang alone does not)."""
    done = subprocess.run(["clang", "--target=aarch64-linux-gnu", "-fopenmp", "-fsyntax-only",
                           "-x", "c", "-"], input="#include <omp.h>\n", capture_output=True,
                          text=True)
    return done.returncode == 0


def check(builds: list[str], log: Callable[[str], None] = print) -> list[str]:
    """Build, run and compare; returns the failures."""
    missing = tools(builds)
    if missing:
        raise RuntimeError(f"missing: {', '.join(missing)} (apt-get install "
                           "gcc-aarch64-linux-gnu qemu-user clang)")
    calls = all_calls()
    lib = native.library("generic")
    if lib is None:
        raise RuntimeError("the x86 generic build is not available")
    ran: dict[str, bool] = {}
    with tempfile.TemporaryDirectory(prefix="localpaged-arm-") as tmp:
        lib8 = x86_int8_library(Path(tmp))
        for call in calls:
            call.results["x86"] = run_ctypes(lib, call)
            call.results["x86-int8"] = run_ctypes(lib8, call)
        for name in builds:
            driver, what = build(name, Path(tmp))
            if driver is None:
                log(what)
                continue
            (Path(tmp) / f"{name}-io").mkdir()
            isa = run_qemu(driver, [Call("probe", "i8_dot_isa", [], [])], Path(tmp), probe=True)
            ran[name] = isa != 0
            log(f"{what}; int8 dot products: {['none', 'AVX2', 'NEON', 'NEON sdot'][isa]}")
            for call, outs in zip(calls, run_qemu(driver, calls, Path(tmp) / f"{name}-io"),
                                  strict=True):
                call.results[name] = outs
    return compare(calls, ran, log)


def x86_int8_library(work: Path) -> ctypes.CDLL:
    """This machine's generic build with float32 activations as int8 in plain C
    (LOCALPAGED_I8_PLAIN): what a build with int8 dot products computes, bit for bit."""
    cc = native._compiler()
    if cc is None:
        raise RuntimeError("no C compiler here")
    path = work / "x86-int8.so"
    flags = [*native.FLAGS, *cpu_isa.compile_flags("generic"), "-DLOCALPAGED_I8_PLAIN"]
    subprocess.run([cc, *flags, str(native.SOURCES / f"{native.ALL}.c"), "-o", str(path)],
                   check=True)
    lib = ctypes.CDLL(str(path))
    for fn, (args, result) in native.SIGNATURES.items():
        getattr(lib, fn).argtypes, getattr(lib, fn).restype = args, result
    return lib


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--builds", default=",".join(BUILDS),
                        help=f"comma-separated, of: {', '.join(BUILDS)}")
    builds = parser.parse_args().builds.split(",")
    unknown = [b for b in builds if b not in BUILDS]
    if unknown:
        parser.error(f"unknown builds: {', '.join(unknown)}")
    torch.set_num_threads(THREADS)
    failures = check(builds)
    for f in failures:
        print("FAIL", f)
    print("all held" if not failures else f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
