"""The step-time bound in the scheduler, with a fake step-cost model (no model, no clock)."""

from __future__ import annotations

import pytest

from localpaged.engine.engine import step_shape
from localpaged.engine.kv_cache import KVCacheManager
from localpaged.engine.request import Request, SamplingParams
from localpaged.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from localpaged.engine.step_bound import AUTO_FLOOR_S, AUTO_MULTIPLE, StepTimeBound
from localpaged.engine.step_cost import StepCostModel, StepShape

BLOCK = 16
BUDGET = 512


class FakeCosts:
    """Decode-only steps: 10 ms + 1 ms a row; prefill steps: `base` (12.05 ms) + 1 ms a row
    + 0.12 ms a prompt token. Every chunk size counts as measured already."""

    mixed_prefill_seen = 10**9

    def __init__(self, base: float = 0.01205) -> None:
        self.base = base

    def decode_step(self, s: StepShape) -> float:
        return 0.010 + 0.001 * s.decodes

    def predict(self, s: StepShape) -> float:
        if not s.prefill_tokens:
            return self.decode_step(s)
        return self.prefill_base(s) + 0.00012 * s.prefill_tokens

    def prefill_base(self, s: StepShape) -> float:
        return self.base + 0.001 * s.decodes

    def target(self, s: StepShape) -> float:
        """The auto target: the prefill path's fixed part + a decode step, at least 2 of them."""
        d = self.decode_step(s)
        return max(AUTO_MULTIPLE * d, self.prefill_base(s) + (AUTO_MULTIPLE - 1) * d)


def scheduler(max_step_ms: float | None = None, costs: object | None = None,
              floor_s: float = 0.0) -> Scheduler:
    """A scheduler whose automatic target has no floor unless asked (the fake costs' steps
    are tens of ms: the floor of 100 ms would hide the multiple)."""
    kv = KVCacheManager(1000, BLOCK, True)
    bound = StepTimeBound(costs or FakeCosts(), max_step_ms, BLOCK,  # type: ignore[arg-type]
                          floor_s=floor_s)
    return Scheduler(SchedulerConfig(BUDGET, 16, max_model_len=20_000), kv, bound)


def add(s: Scheduler, rid: str, prompt_len: int, max_tokens: int = 1000) -> Request:
    r = Request(rid, [1 + (hash(rid) + i) % 50 for i in range(prompt_len)],
                SamplingParams(max_tokens=max_tokens, ignore_eos=True), session_id=rid)
    s.add_request(r)
    return r


def run(s: Scheduler) -> tuple[SchedulerOutput, dict[str, int]]:
    """One step; every request whose chunk reaches its end samples token 7."""
    out = s.schedule()
    chunks = {x.request.request_id: x.num_new_tokens for x in out.scheduled}
    s.update_from_output(out, {x.request.request_id: 7 for x in out.scheduled if x.samples})
    return out, chunks


def test_chunks_shrink_while_a_chat_streams_and_grow_back_when_it_stops() -> None:
    s = scheduler()
    run(s)  # nothing yet
    add(s, "A", 20, max_tokens=6)
    run(s)  # A's prompt, alone: the whole of it
    add(s, "B", 3000)
    _, chunks = run(s)
    # A's decode step alone costs 11 ms, beside a prompt 13.05 ms before its tokens: the target
    # is 13.05 + 11 = 24.05 ms, and 13.05 + 0.12 n <= 24.05 -> n = 91.
    assert chunks == {"A": 1, "B": 91}
    while "A" in s.requests:
        _, chunks = run(s)
        if "A" in chunks:
            assert chunks["B"] == 91
    _, chunks = run(s)  # A is done: B alone uses the whole budget again
    assert chunks == {"B": BUDGET}


def test_the_chunk_is_what_fits_in_the_target() -> None:
    s = scheduler(max_step_ms=40)
    add(s, "A", 20)
    run(s)
    add(s, "B", 3000)
    out, chunks = run(s)
    # 13.05 + 0.12 n <= 40 ms -> n = 224.
    assert chunks["B"] == 224
    assert FakeCosts().predict(step_shape(out)) <= 0.040
    # With two chats streaming, less room is left.
    add(s, "C", 3)
    run(s)
    while s.requests["C"].num_output_tokens == 0:
        run(s)
    _, chunks = run(s)
    assert chunks["B"] == 216


def test_a_path_with_a_large_fixed_cost_still_reads_the_prompt() -> None:
    # Beside a prompt A's row costs 31 ms before the prompt's tokens, ~3 x its step alone: the
    # step may take that + one decode step, 42 ms, and 31 + 0.12 n <= 42 -> n = 91: the same
    # 11 ms of prompt as on a cheap path, not one block.
    s = scheduler(costs=FakeCosts(base=0.030))
    add(s, "A", 20)
    run(s)
    add(s, "B", 3000)
    _, chunks = run(s)
    assert chunks == {"A": 1, "B": 91}


def test_a_path_cheaper_beside_a_prompt_keeps_2x() -> None:
    # Prefill steps cost 5 ms before their tokens: the target stays 2 x 11 ms;
    # 6 + 0.12 n <= 22 -> n = 133.
    s = scheduler(costs=FakeCosts(base=0.005))
    add(s, "A", 20)
    run(s)
    add(s, "B", 3000)
    _, chunks = run(s)
    assert chunks == {"A": 1, "B": 133}


def test_never_below_one_block_and_prefill_always_advances() -> None:
    s = scheduler(max_step_ms=0.001)  # no step can meet it
    add(s, "A", 5, max_tokens=10_000)
    run(s)
    add(s, "B", 200)
    add(s, "C", 40)
    seen_c = False
    while s.requests["B"].num_output_tokens == 0 or s.requests["C"].num_output_tokens == 0:
        decoding = {rid for rid, r in s.requests.items() if r.num_output_tokens}
        _, chunks = run(s)
        prefill = {k: v for k, v in chunks.items() if k not in decoding}
        assert all(chunks[k] == 1 for k in decoding)
        # One chunk per step (no time for a second), of one block or the prompt's rest.
        assert len(prefill) == 1
        (rid, n), = prefill.items()
        r = s.requests[rid]
        assert n == BLOCK or r.num_computed_tokens == r.num_prompt_tokens
        seen_c |= rid == "C"
    assert seen_c
    assert s.requests["B"].num_output_tokens >= 1


def test_steps_without_decodes_keep_the_whole_budget() -> None:
    s = scheduler(max_step_ms=0.001)
    add(s, "B", 3000)
    _, chunks = run(s)
    assert chunks == {"B": BUDGET}


def test_nothing_learned_yet_probes_with_one_block() -> None:
    s = scheduler(costs=StepCostModel())  # auto target, empty model
    add(s, "A", 3)
    run(s)
    add(s, "B", 3000)
    _, chunks = run(s)
    assert chunks == {"A": 1, "B": BLOCK}


@pytest.mark.parametrize("bad", [0, -1.0])
def test_a_fixed_target_must_be_positive(bad: float) -> None:
    with pytest.raises(ValueError, match="max_step_ms"):
        StepTimeBound(FakeCosts(), bad, BLOCK)


def test_learned_costs_keep_steps_within_the_auto_target() -> None:
    """The scheduler and the real cost model, driven by a fake clock: each step 'takes' what
    FakeCosts says. Chat A reads its prompt and streams alone for a while, then B sends a long
    prompt: after a few steps to learn what mixed steps cost, every step carrying A's decode
    and a chunk of B stays within the auto target, with chunks longer than one block."""
    truth = FakeCosts()
    costs = StepCostModel()
    s = scheduler(costs=costs)

    def step() -> tuple[dict[str, int], StepShape]:
        out, chunks = run(s)
        shape = step_shape(out)
        costs.observe(shape, truth.predict(shape))
        return chunks, shape

    add(s, "A", 300, max_tokens=300)
    for _ in range(10):
        step()
    add(s, "B", 3000, max_tokens=1)
    sizes = []
    for i in range(30):  # B's prompt takes ~34 steps
        chunks, shape = step()
        if i >= 3:
            sizes.append(chunks["B"])
            assert truth.predict(shape) <= truth.target(shape) * 1.01
    # 13.05 + 0.12 n <= 24.05 ms: 91 tokens, once learned.
    assert sizes.count(91) >= len(sizes) - 3


def test_chunks_grow_step_by_step_past_what_was_measured() -> None:
    """A model that has seen one short prompt cannot tell fixed from per-token cost yet; the
    first chunks beside a decode double from one block instead of trusting it."""
    costs = StepCostModel()
    for _ in range(3):  # (the first two of each kind are warm-up)
        costs.observe(StepShape().with_chunk(0, 20), 0.014)  # a prompt
        costs.observe(StepShape(1, 21), 0.011)  # a decode step
    s = scheduler(max_step_ms=10_000, costs=costs)  # a target only the ramp holds back
    add(s, "A", 20)
    run(s)
    add(s, "B", 3000)
    sizes = []
    for _ in range(5):
        out, chunks = run(s)
        costs.observe(step_shape(out), 0.02)
        sizes.append(chunks["B"])
    assert sizes == [16, 32, 64, 128, 256]


def test_the_ramp_holds_the_step_not_each_chunk() -> None:
    """Five prompts waiting beside a decode, 16 prompt tokens measured so far: the step reads
    32 in all, not 32 each."""
    costs = FakeCosts()
    costs.mixed_prefill_seen = BLOCK
    s = scheduler(max_step_ms=10_000, costs=costs)
    add(s, "A", 20)
    run(s)
    for i in range(5):
        add(s, f"P{i}", 100)
    _, chunks = run(s)
    assert chunks == {"A": 1, "P0": 2 * BLOCK}


def test_the_automatic_target_is_at_least_the_floor() -> None:
    """Where 2 decode steps are less than 100 ms (here 22 ms), a step carrying a decode may
    take 100 ms: the prompt's chunk is what fits in that (here all the budget left), where
    without the floor it is what fits in 22 ms."""
    def chunk_beside_a_decode(floor_s: float) -> tuple[int, float | None]:
        s = scheduler(floor_s=floor_s)
        add(s, "A", 8)
        run(s)  # A decodes from now on
        add(s, "B", 5000)
        _, chunks = run(s)
        assert chunks["A"] == 1
        return chunks["B"], s.step_target

    costs = FakeCosts()
    fits_in_floor = int((AUTO_FLOOR_S - costs.prefill_base(StepShape(decodes=1))) / 0.00012)
    assert fits_in_floor > BUDGET
    assert chunk_beside_a_decode(AUTO_FLOOR_S) == (BUDGET - 1, pytest.approx(AUTO_FLOOR_S))
    without, target = chunk_beside_a_decode(0.0)
    assert target == pytest.approx(costs.target(StepShape(decodes=1, decode_context=9)))
    assert without < 100
