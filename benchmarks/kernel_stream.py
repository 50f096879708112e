"""How close a one-row 4-bit / 6-bit product (a decode step's matmul) comes to the memory's
read speed: the kernels of every CPU variant this machine runs, over ~1 GiB of weights in huge
pages (as the engine keeps them), beside a plain read loop and the triad that `compare_cpu.py`
takes for its roofline.

A decode step reads every weight once, so its speed is the weights' bytes over the rate the
kernels stream them at. This prints that rate per form (Q4_K's super-block scales; Q6_K's
6-bit codes and group scales) and variant, the plain read's (C, OpenMP, the same threads;
best of no prefetch and a 1 KiB software prefetch), and each kernel's share of it: where the
share is low, the time goes to the kernel's own work around the stream, not to the memory.

    python benchmarks/kernel_stream.py [--gib 1.0] [--repeats 5] [--isa all|avx2,amx,...]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from cpu_class import describe_cpu, memory_bandwidth_gbs  # noqa: E402

from localpaged.kernels import cpu_isa, native  # noqa: E402
from localpaged.model.huge_pages import huge_page_mapping  # noqa: E402
from localpaged.quant import cpu_w6  # noqa: E402

N, K = 8192, 2048  # the gate/up projection of a 1.7B model: one call's matrix

READ_LOOP = r"""
#include <stddef.h>
#include <stdint.h>
/* The sum of n bytes of p as 64-bit words, on the OpenMP team, each thread one contiguous
 * share; `ahead` bytes fetched ahead (0: the hardware prefetchers alone). */
uint64_t read_all(const uint64_t *p, size_t n, int ahead) {
    uint64_t total = 0;
    const size_t words = n / 8;
#pragma omp parallel reduction(+ : total)
    {
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
        const size_t lo = words * t / team, hi = words * (t + 1) / team;
        uint64_t a = 0, b = 0, c = 0, d = 0;
        for (size_t i = lo; i + 8 <= hi; i += 8) {
            if (ahead) __builtin_prefetch((const char *)(p + i) + ahead, 0, 3);
            a += p[i] ^ p[i + 4];
            b += p[i + 1] ^ p[i + 5];
            c += p[i + 2] ^ p[i + 6];
            d += p[i + 3] ^ p[i + 7];
        }
        total += a + b + c + d;
    }
    return total;
}
"""


def read_library() -> ctypes.CDLL:
    """The plain read loop, compiled for this CPU."""
    folder = Path(tempfile.mkdtemp(prefix="kernel-stream-"))
    (folder / "read.c").write_text("#include <omp.h>\n" + READ_LOOP)
    try:
        subprocess.run(["cc", "-O2", "-march=native", "-fopenmp", "-shared", "-fPIC",
                        str(folder / "read.c"), "-o", str(folder / "read.so")], check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        sys.exit(f"the plain read loop needs a C compiler with OpenMP as `cc` ({e}): "
                 "install gcc (e.g. `apt install gcc`) and run again")
    lib = ctypes.CDLL(str(folder / "read.so"))
    lib.read_all.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.read_all.restype = ctypes.c_uint64
    return lib


def plain_read_gbs(nbytes: int, repeats: int) -> tuple[float, float]:
    """GB/s of the plain read over `nbytes` in huge pages: (no prefetch, 1 KiB ahead)."""
    lib = read_library()
    buf, at = huge_page_mapping(nbytes)
    memory = torch.frombuffer(memoryview(buf)[at:at + nbytes], dtype=torch.uint8)
    memory.fill_(1)
    address = memory.data_ptr()
    rates = []
    for ahead in (0, 1024):
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            lib.read_all(address, nbytes, ahead)
            best = min(best, time.perf_counter() - start)
        rates.append(nbytes / best / 1e9)
    del memory
    return rates[0], rates[1]


class Form:
    """One weight form's matrices, as many as make about `nbytes`, side by side in huge pages."""

    def __init__(self, six: bool, nbytes: int) -> None:
        self.six = six
        self.zero_point, self.group_size = (32, 16) if six else (cpu_w6.KQ, 32)
        tiles = N // 16
        sizes = [tiles * K // 4 * 32]  # packed
        sizes.append(tiles * K // 8 * 32 if six else 0)  # high
        sizes.append(tiles * K // 16 * 16 * 2 if six else tiles * K // 256 * cpu_w6.KQ_RECORD * 2)
        self.sizes = sizes
        self.per = -(-sum(sizes) // 4096) * 4096
        self.count = count = max(1, round(nbytes / sum(sizes)))
        self.buf, at = huge_page_mapping(self.per * count)
        whole = torch.frombuffer(memoryview(self.buf)[at:at + self.per * count], dtype=torch.uint8)
        g = torch.Generator().manual_seed(0)
        whole.copy_(torch.randint(0, 256, (whole.numel(),), dtype=torch.uint8, generator=g))
        self.mats = []
        for i in range(count):
            base = i * self.per
            packed = whole[base:base + sizes[0]]
            high = whole[base + sizes[0]:base + sizes[0] + sizes[1]] if six else None
            sb = whole[base + sizes[0] + sizes[1]:base + sum(sizes)]
            self._sane_scales(sb, g)
            self.mats.append((packed.view(tiles, K // 4, 32),
                              None if high is None else high.view(tiles, K // 8, 32),
                              sb.view(torch.float16)))

    def _sane_scales(self, sb: torch.Tensor, g: torch.Generator) -> None:
        """Normal float16 scales (random bits would give NaNs and subnormals) and, for super-
        block records, 6-bit scales and mins."""
        if self.six:
            sb.view(torch.float16).copy_(torch.rand(sb.numel() // 2, generator=g).half() * 0.01)
            return
        records = sb.view(-1, cpu_w6.KQ_RECORD * 2)
        records[:, :64].view(torch.float16).copy_(
            torch.rand(records.shape[0], 32, generator=g).half() * 0.01)
        records[:, 64:].bitwise_and_(63)

    @property
    def nbytes(self) -> int:
        return sum(self.sizes) * self.count

    def gbs(self, isa: str, repeats: int) -> float:
        """GB/s of one-row products over every matrix, best of `repeats` passes."""
        lib = native.library(isa)
        x = torch.randn(1, K)
        y = torch.empty(1, N)
        threads = torch.get_num_threads()
        calls = [(x.data_ptr(), p.data_ptr(), None if h is None else h.data_ptr(), s.data_ptr(),
                  self.zero_point, y.data_ptr(), 1, K, N, self.group_size, threads, 0)
                 for p, h, s in self.mats]
        best = float("inf")
        for _ in range(repeats + 1):  # the first pass warms the library and the threads
            start = time.perf_counter()
            for args in calls:
                lib.w6_gemm_f32(*args)
            best = min(best, time.perf_counter() - start)
        return self.nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="weights per form, GiB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--isa", default="all", help="'all' or a comma list of variants")
    args = ap.parse_args()
    print(describe_cpu())
    isas = [i for i in (cpu_isa.supported() if args.isa == "all" else args.isa.split(","))
            if cpu_w6.available(i)]
    print(f"threads: {torch.get_num_threads()} | one row x [{N} x {K}] per call | "
          f"variants with the int8 kernels: {', '.join(isas) or '-'}")
    nbytes = int(args.gib * 2**30)
    triad = memory_bandwidth_gbs()
    no_prefetch, ahead = plain_read_gbs(nbytes, args.repeats)
    read = max(no_prefetch, ahead)
    print(f"triad {triad:.1f} GB/s | plain read {read:.1f} GB/s "
          f"(no prefetch {no_prefetch:.1f}, 1 KiB ahead {ahead:.1f})\n")
    print("| form | variant | GB/s | share of the plain read | share of the triad |")
    print("|---|---|---|---|---|")
    for name, six in (("Q4_K (4-bit, super-block scales)", False), ("Q6_K (6-bit, group scales)", True)):
        form = Form(six, nbytes)
        for isa in isas:
            rate = form.gbs(isa, args.repeats)
            print(f"| {name} | {isa} | {rate:.1f} | {rate / read:.2f} | {rate / triad:.2f} |",
                  flush=True)
        del form


if __name__ == "__main__":
    main()
