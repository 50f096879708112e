"""One GGUF matrix through the layer the CPU loader builds for its type, per kernel variant.

For each type (IQ4_NL, IQ4_XS, Q4_0, Q6_K, Q8_0 by default) a random matrix of real blocks (random
codes, random float16 scales) of a 1-2B model's shape goes through the layer localpaged keeps
it as (`W6Linear`: 4-bit codes with a code book or symmetric scales, 6-bit codes; `Q8Linear`:
int8 blocks), and IQ4_NL / IQ4_XS also through the int8 blocks they took before (`... as
int8`, the peer in the same run), at decode (1 row), 8 concurrent chats (8 rows) and prefill (128 rows).
Each variant runs in its own process (`LOCALPAGED_CPU_ISA`), torch held to the same class.

    python benchmarks/gguf_layers.py [--isa all|avx2,...] [--types IQ4_NL,Q4_0] [--n 2048 --k 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from localpaged.kernels import cpu_isa

ROWS = (1, 8, 128)


def random_blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """`[n, k]` values of `type_name` as random file bytes with sane float16 scales."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    halves = {"Q6_K": [size - 2]}.get(type_name, [0])  # where the block's float16 d lies
    for at in halves:
        b[:, at:at + 2] = rng.uniform(1e-4, 1e-3, len(b)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(n, -1)


def layer_for(type_name: str, data: np.ndarray, n: int, k: int, as_int8: bool) -> torch.nn.Module:
    """The layer the loader keeps a matrix of `type_name` as (or int8 blocks, `as_int8`)."""
    from localpaged.quant import w6_linear
    from localpaged.quant.ggml_int4 import GgmlInt4Weight
    from localpaged.quant.ggml_int8 import GgmlInt8Weight, int8_blocks
    from localpaged.quant.q8_linear import Q8Linear

    if as_int8:
        return Q8Linear.from_blocks(int8_blocks(type_name, data, n, k))
    if type_name in ("Q4_0", "Q4_K"):
        return w6_linear.from_four_bit(GgmlInt4Weight.from_blocks(type_name, data, n, k))
    weight = GgmlInt8Weight(type_name, data, n, k)
    if w6_linear.wanted(type_name, (n, k)):
        return w6_linear.W6Linear.from_gguf(weight)
    return Q8Linear.from_blocks(weight)


def bytes_per_weight(layer: torch.nn.Module) -> float:
    held = sum(t.numel() * t.element_size() for t in layer.buffers() if t is not None)
    return 8 * held / (layer.in_features * layer.out_features)


def measure(types: list[str], n: int, k: int) -> list[dict]:
    """This process's variant: ms per call and GMAC/s of each layer at each row count."""
    out = []
    cases = [(t, False) for t in types] + [(t, True) for t in types if t in ("IQ4_NL", "IQ4_XS")]
    for type_name, as_int8 in cases:
        layer = layer_for(type_name, random_blocks(type_name, n, k), n, k, as_int8)
        row = {"layer": f"{type_name} as int8" if as_int8 else type_name,
               "kind": type(layer).__name__, "bits": bytes_per_weight(layer)}
        for m in ROWS:
            x = torch.randn(m, k)
            reps = 30 if m < 128 else 5
            layer(x)
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                layer(x)
                times.append(time.perf_counter() - t)
            s = statistics.median(times)
            row[m] = (s * 1e3, m * n * k / s / 1e9)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", default="all", help="variants to run: all, or a comma list")
    ap.add_argument("--types", default="IQ4_NL,IQ4_XS,Q4_0,Q6_K,Q8_0")
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=8192)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    types = args.types.split(",")
    if args.child:
        print(json.dumps(measure(types, args.n, args.k)))
        return
    from benchmarks.cpu_class import describe_cpu, torch_env

    isas = cpu_isa.supported() if args.isa == "all" else args.isa.split(",")
    isas = [i for i in isas if i != "generic"] if args.isa == "all" else isas
    print(describe_cpu())
    print(f"\n[{args.n} x {args.k}] matrix, float32 activations, {torch.get_num_threads()} "
          f"threads; ms per call (GMAC/s)\n")
    print("| variant | layer | kept as | bits/weight | " + " | ".join(f"{m} rows" for m in ROWS) + " |")
    print("|---|---|---|---|" + "---|" * len(ROWS))
    for isa in isas:
        env = {**os.environ, **torch_env(isa), cpu_isa.ENV: isa}
        done = subprocess.run([sys.executable, "-m", "benchmarks.gguf_layers", "--child",
                               "--types", args.types, "--n", str(args.n), "--k", str(args.k)],
                              env=env, capture_output=True, text=True, check=True)
        for row in json.loads(done.stdout.strip().splitlines()[-1]):
            cells = " | ".join(f"{row[str(m)][0]:.2f} ({row[str(m)][1]:.0f})" for m in ROWS)
            print(f"| {isa} | {row['layer']} | {row['kind']} | {row['bits']:.2f} | {cells} |")


if __name__ == "__main__":
    main()
