"""Single-stream decode of a mixture-of-experts GGUF against a dense one of about its total
size, localpaged (defaults) and llama.cpp on the same files (issue 15's speed check).

Each engine and file runs in a fresh process, one after another, `--rounds` times in
alternation; a run times a 32-token prompt answered with 1 token and with 1 + `--new` tokens
(greedy, ignore_eos) and reports `new` / the difference: decode steps only. The table gives
the medians, the files' parameters (all, and read a token) and the CPU's flags.

    python benchmarks/moe_decode.py MOE.gguf DENSE.gguf [AWQ_OR_GPTQ_FOLDER ...] [--rounds 3]

An AWQ / GPTQ folder runs on localpaged alone (llama.cpp reads GGUF files).

PEERS_PYTHON names the Python with llama-cpp-python (default /work/peers-venv/bin/python).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MARK = "MOE_DECODE_RESULT "

LOCALPAGED = r"""
import json, sys, time
from localpaged import LLM, SamplingParams
llm, new = LLM(sys.argv[1]), int(sys.argv[2])
def answer(first, n):
    t = time.perf_counter()
    llm.generate([list(range(first, first + 32))], SamplingParams(temperature=0, max_tokens=n,
                                                                   ignore_eos=True))
    return time.perf_counter() - t
answer(500, 4)  # warm up
one, many = answer(1000, 1), answer(2000, 1 + new)
print(sys.argv[3] + json.dumps({"decode_tok_s": new / (many - one)}))
"""

LLAMA_CPP = r"""
import json, sys, time
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=512, n_threads=2, n_threads_batch=2,
                      verbose=False)
new = int(sys.argv[2])
def answer(first, n):
    llm.reset()
    t = time.perf_counter()
    llm.eval(list(range(first, first + 32)))
    for _ in range(n):
        llm.eval([int(llm.sample(temp=0.0, top_k=1))])
    return time.perf_counter() - t
answer(500, 4)
one, many = answer(1000, 0), answer(2000, new)
print(sys.argv[3] + json.dumps({"decode_tok_s": new / (many - one)}))
"""


def run(engine: str, path: str, new: int) -> float:
    python = (os.environ.get("PEERS_PYTHON", "/work/peers-venv/bin/python")
              if engine == "llama.cpp" else sys.executable)
    code = LLAMA_CPP if engine == "llama.cpp" else LOCALPAGED
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    proc = subprocess.run([python, "-c", code, path, str(new), MARK], capture_output=True,
                          text=True, env=env, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    if proc.returncode or not lines:
        raise SystemExit(f"{engine} on {path} failed: {proc.stderr.strip()[-500:]}")
    return json.loads(lines[-1].removeprefix(MARK))["decode_tok_s"]


def facts(path: str) -> str:
    from localpaged.model.gguf_loader import open_gguf

    if not path.endswith(".gguf"):  # an AWQ / GPTQ folder
        from localpaged.model.config import ModelConfig

        q = ModelConfig.from_pretrained(path).quantization_config or {}
        size = sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) / 2**30
        return f"{size:.2f} GiB, {q.get('quant_method')} desc_act={q.get('desc_act', False)}"

    f = open_gguf(path)
    total = f.parameter_count
    cfg = f.hf_config()
    experts, used = cfg.get("num_experts", 0), cfg.get("num_experts_per_tok", 0)
    inactive = 0
    if experts:
        moe_layers = cfg["num_hidden_layers"] - len(cfg.get("mlp_only_layers", []))
        inactive = moe_layers * (experts - used) * 3 * cfg["hidden_size"] * cfg[
            "moe_intermediate_size"]
    size = Path(path).stat().st_size / 2**30
    return (f"{total / 1e9:.2f} B parameters, {(total - inactive) / 1e9:.2f} B read a token, "
            f"{size:.2f} GiB, {f.quantization}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=48)
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from cpu_class import describe_cpu

    print(describe_cpu())
    engines = ("localpaged", "llama.cpp")
    got: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for path in args.files:
            for engine in engines if path.endswith(".gguf") else engines[:1]:
                rate = run(engine, path, args.new)
                got.setdefault((engine, path), []).append(rate)
                print(f"  round {r + 1}: {engine} {Path(path).name}: {rate:.1f} tok/s", flush=True)
    print(f"\nsingle-stream decode, tok/s (median of {args.rounds}; {args.new} new tokens after "
          "a 32-token prompt)")
    print(f"{'file':<34}{'localpaged':>12}{'llama.cpp':>12}   what it is")
    for path in args.files:
        ours, peer = (statistics.median(got.get((e, path), [float("nan")])) for e in engines)
        print(f"{Path(path).name:<34}{ours:>12.1f}{peer:>12.1f}   {facts(path)}")


if __name__ == "__main__":
    main()
