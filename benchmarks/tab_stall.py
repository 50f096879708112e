"""Does one chat stall another? A chat streams while others send long prompts (issue 17).

Chat A streams 128 tokens; at A's 10th token chat B sends a 3000-token prompt, then 4 more
chats send 1000-token prompts. Measured, per compute path (the CPU's default dtype and
float32), without the step-time bound (before: max_step_ms=0) and with it (after: the
default, 2x a decode-only step and at least 100 ms), each on an engine of its own:

    A's median gap between tokens alone, and its p50 / p99 / longest gap in the mix
    B's time to first token alone and in the mix
    total throughput of the mix (generated tokens/s, all tokens/s)

The issue's targets: A's p99 gap <= 2.5x its median alone, B's TTFT <= 1.3x alone, and
throughput within 10% of before. Prompts are random token ids, new ones for each phase, so
no phase reads another's blocks from the prefix cache.

    python benchmarks/tab_stall.py [--model PATH_OR_NAME] [--dtypes auto,float32]
    python benchmarks/tab_stall.py --tokens 16 --long-prompt 300 --other-prompt 100  # quick
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from localpaged import SamplingParams
from localpaged.engine.async_engine import LocalClient


def default_model() -> str:
    """The SmolLM2-135M Q4_1 GGUF the tests cache (fetched on first use)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import conftest

    return str(conftest.smollm_gguf.__wrapped__())


@dataclass
class Stream:
    """When one request's tokens arrived (seconds since the run started)."""

    submitted: float
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.submitted

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    xs = sorted(xs)
    return xs[max(0, -(-len(xs) * q // 100) - 1)] if xs else float("nan")


class Prompts:
    """Fresh random prompts (never a prefix-cache hit on an earlier one)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.g = torch.Generator().manual_seed(0)

    def __call__(self, length: int) -> list[int]:
        return torch.randint(100, self.vocab - 1, (length,), generator=self.g).tolist()


async def stream(client: LocalClient, prompt: list[int], tokens: int, t0: float,
                 session: str, on_token: Callable[[int], None] | None = None) -> Stream:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    s = Stream(time.perf_counter() - t0)
    async for d in client.generate(prompt, params, session_id=session):
        for _ in d.token_ids:
            s.token_times.append(time.perf_counter() - t0)
            if on_token is not None:
                on_token(len(s.token_times))
    return s


async def alone(client: LocalClient, prompt: list[int], tokens: int) -> Stream:
    return await stream(client, prompt, tokens, time.perf_counter(), "alone")


async def mix(client: LocalClient, prompts: Prompts, a: argparse.Namespace
              ) -> tuple[Stream, Stream, list[Stream], float, int]:
    """The scenario; returns A, B, the others, the wall time and all tokens computed."""
    t0 = time.perf_counter()
    others: list[asyncio.Task[Stream]] = []
    b_prompt, other_prompts = prompts(a.long_prompt), [prompts(a.other_prompt)
                                                       for _ in range(a.others)]

    def at_token(n: int) -> None:
        if n == a.at_token:  # B, then the others, as A's tab shows its 10th token
            others.append(asyncio.create_task(
                stream(client, b_prompt, a.answer_tokens, t0, "B")))
            others.extend(asyncio.create_task(stream(client, p, a.answer_tokens, t0, f"C{i}"))
                          for i, p in enumerate(other_prompts))

    a_stream = await stream(client, prompts(a.short_prompt), a.tokens, t0, "A", at_token)
    rest = await asyncio.gather(*others)
    wall = time.perf_counter() - t0
    computed = (a.short_prompt + a.tokens + a.long_prompt + a.others * a.other_prompt
                + (1 + a.others) * a.answer_tokens)
    return a_stream, rest[0], rest[1:], wall, computed


def measure(model: str, dtype: str, max_step_ms: float | None, a: argparse.Namespace
            ) -> dict[str, float]:
    client = LocalClient.from_model(model, dtype=dtype, max_step_ms=max_step_ms)
    try:
        prompts = Prompts(client.engine.model_config.vocab_size)
        asyncio.run(alone(client, prompts(64), 8))  # warm-up: kernels built, pages touched
        a_alone = asyncio.run(alone(client, prompts(a.short_prompt), a.tokens))
        b_alone = asyncio.run(alone(client, prompts(a.long_prompt), 1))
        a_mix, b_mix, _, wall, computed = asyncio.run(mix(client, prompts, a))
        generated = a.tokens + (1 + a.others) * a.answer_tokens
        return {
            "dtype": str(client.model_info.dtype),
            "a_alone_p50": statistics.median(a_alone.gaps), "a_p50": pct(a_mix.gaps, 50),
            "a_p99": pct(a_mix.gaps, 99), "a_max": max(a_mix.gaps),
            "b_alone_ttft": b_alone.ttft, "b_ttft": b_mix.ttft,
            "gen_tok_s": generated / wall, "all_tok_s": computed / wall, "wall": wall,
        }
    finally:
        client.async_engine.close()


def table(results: dict[tuple[str, str], dict[str, float]], dtypes: list[str]) -> str:
    ms = 1e3
    rows = [
        ("A alone: median gap, ms", lambda r: r["a_alone_p50"] * ms, "{:.1f}"),
        ("A in the mix: median gap, ms", lambda r: r["a_p50"] * ms, "{:.1f}"),
        ("A in the mix: p99 gap, ms", lambda r: r["a_p99"] * ms, "{:.1f}"),
        ("A in the mix: longest gap, ms", lambda r: r["a_max"] * ms, "{:.1f}"),
        ("A p99 / alone median (<= 2.5)", lambda r: r["a_p99"] / r["a_alone_p50"], "{:.2f}"),
        ("B alone: TTFT, s", lambda r: r["b_alone_ttft"], "{:.2f}"),
        ("B in the mix: TTFT, s", lambda r: r["b_ttft"], "{:.2f}"),
        ("B TTFT / alone (<= 1.3)", lambda r: r["b_ttft"] / r["b_alone_ttft"], "{:.2f}"),
        ("mix: generated tok/s", lambda r: r["gen_tok_s"], "{:.1f}"),
        ("mix: all tokens/s", lambda r: r["all_tok_s"], "{:.0f}"),
        ("mix: wall time, s", lambda r: r["wall"], "{:.1f}"),
    ]
    w = 32
    head = f"{'':<{w}}" + "".join(
        f"{results[(d, 'before')]['dtype'] + ' before':>17}{'after':>9}" for d in dtypes)
    lines = [head, "-" * len(head)]
    for name, get, fmt in rows:
        cells = "".join(f"{fmt.format(get(results[(d, 'before')])):>17}"
                        f"{fmt.format(get(results[(d, 'after')])):>9}" for d in dtypes)
        lines.append(f"{name:<{w}}{cells}")
    cells = "".join(f"{'':>17}{results[(d, 'after')]['all_tok_s'] / results[(d, 'before')]['all_tok_s']:>9.2f}"
                    for d in dtypes)
    lines.append(f"{'throughput after / before (>= .9)':<{w}}{cells}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the tests' SmolLM2-135M Q4_1 GGUF")
    ap.add_argument("--dtypes", default="auto,float32")
    ap.add_argument("--tokens", type=int, default=128, help="A's answer")
    ap.add_argument("--short-prompt", type=int, default=32, help="A's prompt")
    ap.add_argument("--at-token", type=int, default=10, help="B arrives at A's n-th token")
    ap.add_argument("--long-prompt", type=int, default=3000, help="B's prompt")
    ap.add_argument("--others", type=int, default=4)
    ap.add_argument("--other-prompt", type=int, default=1000)
    ap.add_argument("--answer-tokens", type=int, default=32, help="B's and the others' answers")
    ap.add_argument("--max-step-ms", type=float, default=None,
                    help="the 'after' bound (default: automatic)")
    a = ap.parse_args()
    if not 1 <= a.at_token < a.tokens:
        ap.error("--at-token must be in [1, --tokens)")
    model = a.model or default_model()
    dtypes = a.dtypes.split(",")
    print(f"model {model} | {torch.get_num_threads()} threads | A: {a.short_prompt}-token "
          f"prompt, {a.tokens} tokens | at A's token {a.at_token}: B {a.long_prompt} tokens, "
          f"then {a.others} x {a.other_prompt} | answers {a.answer_tokens} tokens", flush=True)
    results = {}
    for dtype in dtypes:
        for label, bound in (("before", 0.0), ("after", a.max_step_ms)):
            results[(dtype, label)] = measure(model, dtype, bound, a)
            print(f"  {dtype} {label}: done in {results[(dtype, label)]['wall']:.1f} s",
                  file=sys.stderr, flush=True)
    print(table(results, dtypes))


if __name__ == "__main__":
    main()
