"""From a fresh process to the first token, and the process's peak memory: localpaged with its
defaults against llama.cpp (llama-cpp-python) on the same GGUF file (issue 14's load and
memory targets: load <= 2x llama.cpp's, peak RSS <= 1.15x llama.cpp's).

Each engine runs in a fresh process, one after the other (never at once), `--repeats` times,
the file read once before so both find it in the page cache (this times the load, not the
disk), after one untimed run of each (compiled modules, packed weights and kernels written, as
after a user's first start). A process imports its engine, loads the model, reads a 16-token prompt and returns one
token (greedy); the parent times it from spawn to the line the process prints with its first
token (what follows, the interpreter's exit, is not the user's wait). localpaged runs the
engine behind `localpaged chat` and the API (`LocalClient`). Peak RSS is the child's maximum
resident set (`ru_maxrss`), which counts the pages of a memory-mapped file it has touched, as
llama.cpp's weights are: at the first token, and (the target's) once localpaged's work after
load is done too (the weights' move into huge pages while idle). llama.cpp gets
`n_ctx=2048`; localpaged its default KV pool (pages taken as written). The machine's CPU flags are printed first.

    python benchmarks/first_token.py MODEL.gguf [MODEL.gguf | AWQ_OR_GPTQ_FOLDER ...] [--repeats 3]

PEERS_PYTHON names the Python with llama-cpp-python (default /work/peers-venv/bin/python).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MARK = "FIRST_TOKEN_RESULT "
PROMPT = list(range(1000, 1016))

# The engine behind `localpaged chat` and the API (what a user waits on). After its first
# token the process waits until the engine's work after load (the weights' move into huge
# pages, while idle) is done: the peak RSS counts it too.
LOCALPAGED = r"""
import asyncio, json, resource, sys, time
t0 = time.perf_counter()
from localpaged import SamplingParams
from localpaged.engine.async_engine import LocalClient
t1 = time.perf_counter()
client = LocalClient.from_model(sys.argv[1])
t2 = time.perf_counter()

async def first() -> None:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    async for _ in client.generate(json.loads(sys.argv[2]), params):
        pass

asyncio.run(first())
t3 = time.perf_counter()
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(sys.argv[3] + json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "token_s": t3 - t2,
                                "rss_mib": rss()}), flush=True)
client.async_engine.idle_work_done.wait()
print(sys.argv[3] + json.dumps({"settled_rss_mib": rss()}), flush=True)
client.async_engine.close()
"""

LLAMA_CPP = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import llama_cpp
t1 = time.perf_counter()
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=2048, n_threads=2, n_threads_batch=2,
                      verbose=False)
t2 = time.perf_counter()
llm.eval(json.loads(sys.argv[2]))
llm.sample(temp=0.0, top_k=1)
t3 = time.perf_counter()
print(sys.argv[3] + json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "token_s": t3 - t2,
                                "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}),
      flush=True)
"""


# As a user's Python runs: compiled modules kept and reused (this project's machines set
# PYTHONDONTWRITEBYTECODE, which recompiles every module of an editable install each start).
CHILD_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def run(python: str, code: str, model: str) -> dict[str, float]:
    """One fresh process: its own timings, its peak RSS and the wall time from spawn to its
    first token (the line it prints then; its exit is not counted)."""
    t = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen([python, "-c", code, model, json.dumps(PROMPT), MARK],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=CHILD_ENV)
        assert proc.stdout is not None
        line, wall = None, 0.0
        for ln in proc.stdout:
            if ln.startswith(MARK):
                wall, line = time.perf_counter() - t, ln
                break
        rest, _ = proc.communicate()
        err.seek(0)
        if proc.returncode != 0 or line is None:
            raise RuntimeError(f"{python} failed on {model}:\n{err.read()[-2000:]}")
    out = {**json.loads(line.removeprefix(MARK)), "wall_s": wall}
    out["first_rss_mib"] = out["rss_mib"]
    for ln in rest.splitlines():  # a later peak (localpaged's work after its first token)
        if ln.startswith(MARK):
            out["rss_mib"] = max(out["rss_mib"], json.loads(ln.removeprefix(MARK))["settled_rss_mib"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from cpu_class import describe_cpu

    print(describe_cpu())
    peers = os.environ.get("PEERS_PYTHON", "/work/peers-venv/bin/python")
    engines = {"localpaged": (sys.executable, LOCALPAGED)}
    if Path(peers).exists():
        engines["llama.cpp"] = (peers, LLAMA_CPP)
    else:
        print(f"llama.cpp: {peers} not found (set PEERS_PYTHON): left out")
    print("| model | MiB | engine | spawn to first token, s | import, s | load, s | first "
          "token, s | peak RSS at the first token, MiB | peak RSS, MiB |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        files = sorted(Path(model).glob("*")) if Path(model).is_dir() else [Path(model)]
        for file in files:  # into the page cache
            with open(file, "rb") as f:
                while f.read(1 << 24):
                    pass
        size = sum(f.stat().st_size for f in files) / 2**20
        # an AWQ / GPTQ folder: localpaged alone (llama.cpp reads GGUF files)
        here = {n: e for n, e in engines.items() if n == "localpaged" or model.endswith(".gguf")}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in here}
        for python, code in here.values():  # untimed: writes the compiled modules and, at a
            run(python, code, model)  # file's first load, its packed weights and kernels
        os.sync()  # their pages on disk now, not written back beside the timed runs
        for _ in range(args.repeats):  # alternating, so drift weighs on both alike
            for name, (python, code) in here.items():
                runs[name].append(run(python, code, model))
        for name, rs in runs.items():
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            print(f"| {Path(model).name} | {size:.0f} | {name} | {med['wall_s']:.2f} | "
                  f"{med['import_s']:.2f} | {med['load_s']:.2f} | {med['token_s']:.2f} | "
                  f"{med['first_rss_mib']:.0f} | {med['rss_mib']:.0f} |", flush=True)
        if len(runs) == 2:
            a, b = (statistics.median(r["wall_s"] for r in runs[n]) for n in here)
            ra, rb = (statistics.median(r["rss_mib"] for r in runs[n]) for n in here)
            fa, fb = (statistics.median(r["first_rss_mib"] for r in runs[n]) for n in here)
            print(f"| {Path(model).name} | | localpaged / llama.cpp | {a / b:.2f} (<= 2) | | | | "
                  f"{fa / fb:.2f} | {ra / rb:.2f} (<= 1.15) |", flush=True)


if __name__ == "__main__":
    main()
