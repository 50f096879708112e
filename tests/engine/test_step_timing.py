"""The engine times its steps: a fake clock drives the step-cost model, the step-time bound and
the inter-token latencies, on a real (tiny) model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from localpaged import LLM, SamplingParams
from localpaged.engine.engine import LLMEngine, step_shape
from localpaged.engine.step_bound import AUTO_MULTIPLE
from localpaged.engine.step_cost import StepShape


def fake_cost(s: StepShape) -> float:
    """Decode-only steps 10 ms + 1 ms a row; prefill steps 12.05 ms + 1 ms a row + 0.12 ms a
    prompt token."""
    if not s.prefill_tokens:
        return 0.010 + 0.001 * s.decodes
    return 0.01205 + 0.001 * s.decodes + 0.00012 * s.prefill_tokens


def on_fake_clock(engine: LLMEngine) -> list[tuple[StepShape, float]]:
    """Make each step of `engine` take fake_cost(its batch) on engine.clock; returns the log
    of (shape, seconds) it fills."""
    now = [0.0]
    log: list[tuple[StepShape, float]] = []
    execute = engine.runner.execute

    def timed(sched: Any, kv: Any) -> Any:
        shape = step_shape(sched)
        log.append((shape, fake_cost(shape)))
        now[0] += fake_cost(shape)
        return execute(sched, kv)

    engine.runner.execute = timed  # type: ignore[method-assign]
    engine.clock = lambda: now[0]
    return log


def test_a_streaming_chat_waits_at_most_the_bound_for_a_long_prompt(tiny_llama: Path) -> None:
    engine = LLM(str(tiny_llama), dtype="float32", block_size=4, max_step_ms=None).engine  # auto
    # The fake machine's steps are tens of ms: the automatic target's 100 ms floor would hide
    # the learned multiple (the floor has its test in test_step_bound).
    engine.scheduler.time_bound.floor_s = 0.0
    log = on_fake_clock(engine)
    a = engine.add_request(list(range(5, 25)), SamplingParams(temperature=0, max_tokens=60,
                                                                ignore_eos=True))
    for _ in range(10):
        engine.step()
    engine.add_request(list(range(30, 430)), SamplingParams(temperature=0, max_tokens=1))
    gaps_before = engine.itl.count
    while engine.has_unfinished_requests():
        engine.step()
    # The model learned the fake machine: a step of A's decode and a chunk of B may take the
    # 13.05 ms its fixed part costs + 11 ms; 13.05 + 0.12 n <= 24.05 gives n = 91, reached by
    # doubling from one block (B's first step is the prefill kind's second, a warm-up step
    # not learned from: one block again).
    chunks = [s.prefill_tokens for s, _ in log if s.decodes and s.prefill_tokens]
    assert chunks[:6] == [4, 4, 8, 16, 32, 64] and sum(chunks) == 400
    assert all(90 <= c <= 92 for c in chunks[6:-1])  # the fit's slopes lean a little low
    probe = StepShape(1, 100).with_chunk(0, 91)
    assert engine.step_costs.predict(probe) == pytest.approx(fake_cost(probe), rel=1e-2)
    # A's inter-token gaps are the fake step times: 11 ms alone, <= 24.05 ms beside B's chunks.
    lat = engine.itl.summary()
    assert gaps_before == 9
    assert lat.count == a.num_output_tokens - 1  # B's one token makes no gap
    assert min(lat.recent) == pytest.approx(0.011)
    assert max(lat.recent) <= (0.01305 + (AUTO_MULTIPLE - 1) * 0.011) * 1.01
    assert max(lat.recent) > 0.023  # B's chunks did ride along
    assert lat.p50 == pytest.approx(0.011)


def test_without_decodes_the_prompt_gets_the_whole_budget(tiny_llama: Path) -> None:
    engine = LLM(str(tiny_llama), dtype="float32", block_size=4,
                 max_num_batched_tokens=128, max_step_ms=0.001).engine
    log = on_fake_clock(engine)
    engine.add_request(list(range(30, 430)), SamplingParams(temperature=0, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert [s.prefill_tokens for s, _ in log] == [128, 128, 128, 16, 0]
    assert engine.stats().step_bound == "0.001 ms"
