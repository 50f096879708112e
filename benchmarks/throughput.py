"""End-to-end throughput: localpaged vs transformers.generate on the same model and prompts.

For 1, 8 and 32 concurrent requests: aggregate output tokens/s, time to first token and
inter-token latency percentiles. localpaged streams through its AsyncEngine (continuous
batching); transformers runs the same prompts as one left-padded batch.

    python benchmarks/throughput.py [--model PATH_OR_NAME] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import torch

from localpaged import SamplingParams
from localpaged.engine.async_engine import LocalClient


def default_model() -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import conftest  # the test fixtures know how to fetch and convert SmolLM2-135M

    return str(conftest.smollm_hf_dir.__wrapped__(conftest.smollm_gguf.__wrapped__()))


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 1, (length,), generator=g).tolist() for _ in range(n)]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run_localpaged(client: LocalClient, prompts: list[list[int]], new: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    ttfts: list[float] = []
    itls: list[float] = []

    async def one(p: list[int], i: int) -> int:
        start = last = time.perf_counter()
        n = 0
        async for d in client.generate(p, params, session_id=f"s{i}"):
            now = time.perf_counter()
            if d.token_ids:
                if n == 0:
                    ttfts.append(now - start)
                else:
                    itls.append(now - last)
                n += len(d.token_ids)
                last = now
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(p, i) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    return {"tok_s": sum(counts) / wall, "ttft": ttfts, "itl": itls, "wall": wall}


def hf_timed_generate(model, prompts: list[list[int]], new: int) -> tuple[float, float]:
    """transformers.generate on one unpadded batch: (time to the first token, time for all)."""
    ids = torch.tensor(prompts)
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
        wall = time.perf_counter() - t0
    return ttft, wall


def run_hf(model, prompts: list[list[int]], new: int) -> dict:
    ttft, wall = hf_timed_generate(model, prompts, new)
    itl = (wall - ttft) / max(1, new - 1)
    return {"tok_s": len(prompts) * new / wall, "ttft": [ttft] * len(prompts),
            "itl": [itl], "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    model_path = args.model or default_model()
    torch.set_num_threads(torch.get_num_threads())
    client = LocalClient.from_model(model_path, dtype=args.dtype)
    vocab = client.engine.model_config.vocab_size
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype)).eval()
        hf.generation_config.eos_token_id = None

    device = client.model_info.device
    print(f"model {model_path} | {args.dtype} | {device} | {torch.get_num_threads()} threads | "
          f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens each")
    header = (f"{'engine':<14}{'conc':>5}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p90':>10}"
              f"{'ITL p50':>9}{'ITL p90':>9}{'ITL p99':>9}")
    print(header)
    print("-" * len(header))
    # Warm up both (first calls allocate and pick kernels).
    asyncio.run(run_localpaged(client, make_prompts(2, 16, vocab, 99), 4))
    if hf is not None:
        run_hf(hf, make_prompts(1, 16, vocab, 99), 2)
    for conc in (int(c) for c in args.concurrency.split(",")):
        prompts = make_prompts(conc, args.prompt_len, vocab, seed=conc)
        rows = [("localpaged", asyncio.run(run_localpaged(client, prompts, args.new_tokens)))]
        if hf is not None:
            rows.append(("transformers", run_hf(hf, prompts, args.new_tokens)))
        for name, r in rows:
            ms = 1000
            print(f"{name:<14}{conc:>5}{r['tok_s']:>9.1f}{pct(r['ttft'], .5) * ms:>8.0f}ms"
                  f"{pct(r['ttft'], .9) * ms:>8.0f}ms{pct(r['itl'], .5) * ms:>7.1f}ms"
                  f"{pct(r['itl'], .9) * ms:>7.1f}ms{pct(r['itl'], .99) * ms:>7.1f}ms")
        if hf is not None:
            print(f"{'':<14}{'':>5}  localpaged / transformers: "
                  f"{rows[0][1]['tok_s'] / rows[1][1]['tok_s']:.2f}x tokens/s")
    s = client.stats()
    print(f"\nlocalpaged: {s.steps} steps, {s.num_preemptions} preemptions, "
          f"prefix-cache hit rate {s.prefix_cache_hit_rate:.0%}")
    client.async_engine.close()


if __name__ == "__main__":
    main()
