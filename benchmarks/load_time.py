"""Time `load_model` of a GGUF file and report the process's peak RSS, one fresh process per
dtype (the parsed-file cache and the RSS peak are per process).

    python benchmarks/load_time.py MODEL.gguf [--dtype float32 bfloat16] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import torch
from localpaged.model.loader import load_model
t1 = time.perf_counter()
if sys.argv[3] == "1":
    import cProfile, pstats
    prof = cProfile.Profile(); prof.enable()
model, _ = load_model(sys.argv[1], sys.argv[2])
t2 = time.perf_counter()
if sys.argv[3] == "1":
    prof.disable(); pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def measure(path: str, dtype: str, profile: bool) -> dict:
    """One fresh process loading `path` in `dtype`."""
    out = subprocess.run([sys.executable, "-c", CHILD, path, dtype, str(int(profile))],
                         check=True, capture_output=True, text=True, env=os.environ)
    if profile:
        print(out.stderr[-6000:], file=sys.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    with open(args.model, "rb") as f:  # the file in the page cache: time the load, not the disk
        while f.read(1 << 24):
            pass
    size = os.path.getsize(args.model) / 2**20
    print(f"{args.model} ({size:.0f} MiB), {os.cpu_count()} CPUs")
    print("| dtype | load, s | peak RSS, MiB |\n|---|---|---|")
    for dtype in args.dtype:
        r = measure(args.model, dtype, args.profile)
        print(f"| {dtype} | {r['load_s']:.2f} | {r['peak_rss_mib']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
