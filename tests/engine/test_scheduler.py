"""Scheduler invariants, driven by a simulated model that writes each token into its KV slot.

The simulation keeps what every cache slot holds, so a step that lets a request attend to a
slot holding another token (a wrong prefix hit, a stale block) fails the test."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from localpaged.engine.kv_cache import KVCacheManager
from localpaged.engine.request import Request, RequestStatus, SamplingParams
from localpaged.engine.scheduler import Scheduler, SchedulerConfig
from localpaged.engine.step_bound import StepTimeBound
from localpaged.engine.step_cost import StepCostModel, StepShape


def next_token(tokens: list[int]) -> int:
    """Deterministic stand-in for a model: depends on the whole context."""
    return (sum(tokens) * 31 + len(tokens)) % 7


class Sim:
    def __init__(self, num_blocks: int, bs: int, budget: int, max_seqs: int, caching: bool = True,
                 max_step_ms: float | None = 0):
        self.kv = KVCacheManager(num_blocks, bs, caching)
        # A step-time bound (max_step_ms != 0) learns from a simulated clock: 1 ms a step plus
        # 0.1 ms a token.
        self.costs = StepCostModel()
        bound = None if max_step_ms == 0 else StepTimeBound(self.costs, max_step_ms, bs)
        self.s = Scheduler(SchedulerConfig(budget, max_seqs, max_model_len=10_000), self.kv,
                           bound)
        self.slots: dict[int, tuple[int, int]] = {}  # slot -> (position, token)
        self.bs = bs

    def step(self) -> list[Request]:
        out = self.s.schedule()
        cfg = self.s.config
        assert out.num_tokens <= cfg.max_num_batched_tokens
        assert len(self.s.running) <= cfg.max_num_seqs
        assert all(x.num_new_tokens >= 1 for x in out.scheduled)
        assert len({x.request.request_id for x in out.scheduled}) == len(out.scheduled)
        sampled = {}
        shape = StepShape()
        for x in out.scheduled:
            r = x.request
            shape = shape.with_chunk(r.num_computed_tokens, x.num_new_tokens)
            blocks = self.kv.block_ids(r.request_id)
            start, end = r.num_computed_tokens, r.num_computed_tokens + x.num_new_tokens
            assert end <= r.num_tokens
            for p in range(start, end):  # "write K/V"
                self.slots[blocks[p // self.bs] * self.bs + p % self.bs] = (p, r.all_token_ids[p])
            for p in range(end):  # "attend": every context slot holds this request's token
                assert self.slots.get(blocks[p // self.bs] * self.bs + p % self.bs) == (
                    p, r.all_token_ids[p]), f"{r} reads a wrong slot at position {p}"
            if x.samples:
                sampled[r.request_id] = next_token(r.all_token_ids)
        if shape.prefill_tokens:
            self.costs.observe(shape, 0.001 + 0.0001 * shape.prefill_tokens)
        finished = self.s.update_from_output(out, sampled)
        check_invariants(self.kv)
        return finished


def check_invariants(kv: KVCacheManager) -> None:
    refs: dict[int, int] = {}
    for blocks in kv.req_blocks.values():
        for b in blocks:
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
    for b in kv.pool.blocks:
        assert b.ref_cnt == refs.get(b.block_id, 0) >= 0
        assert (b.ref_cnt == 0) == (b.block_id in kv.pool.free_queue)
    for h, b in kv.pool.cached.items():
        assert b.block_hash == h


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
    return out


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_every_request_finishes_with_exact_tokens(data: st.DataObject) -> None:
    bs = data.draw(st.sampled_from([1, 2, 4]))
    reqs_spec = data.draw(st.lists(
        st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=20), st.integers(1, 6),
                  st.sampled_from(["s1", "s2", "s3"])),
        min_size=1, max_size=8))
    longest = max(len(p) + m for p, m, _ in reqs_spec)
    num_blocks = data.draw(st.integers(-(-longest // bs), 3 * -(-longest // bs) + 4))
    sim = Sim(num_blocks, bs, budget=data.draw(st.integers(1, 24)),
              max_seqs=data.draw(st.integers(1, 6)), caching=data.draw(st.booleans()),
              max_step_ms=data.draw(st.sampled_from([0, None, 0.001, 1.5])))
    reqs = []
    for i, (prompt, max_tokens, session) in enumerate(reqs_spec):
        r = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    session_id=session)
        sim.s.add_request(r)
        reqs.append(r)
    aborted = set()
    for _ in range(2000):
        if not sim.s.has_unfinished_requests():
            break
        if data.draw(st.integers(0, 20)) == 0:
            live = sorted(sim.s.requests)
            if live:
                rid = data.draw(st.sampled_from(live))
                sim.s.finish_request(rid, RequestStatus.FINISHED_ABORTED)
                aborted.add(rid)
                check_invariants(sim.kv)
        sim.step()
    assert not sim.s.has_unfinished_requests(), "requests left unfinished"
    assert sim.kv.num_used_blocks == 0
    for r, (prompt, max_tokens, _) in zip(reqs, reqs_spec):
        if r.request_id in aborted:
            assert r.status == RequestStatus.FINISHED_ABORTED
        else:
            assert r.status == RequestStatus.FINISHED_LENGTH
            assert r.output_token_ids == reference_output(prompt, max_tokens)


def test_preemption_recomputes_and_keeps_tokens() -> None:
    # Pool of 6 blocks of 2: two requests of 4 + 6 tokens cannot both hold their blocks.
    sim = Sim(num_blocks=6, bs=2, budget=64, max_seqs=4)
    prompts = [[1, 2, 3, 1], [2, 2, 1, 3]]
    for i, p in enumerate(prompts):
        sim.s.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=6, ignore_eos=True)))
    reqs = list(sim.s.requests.values())
    while sim.s.has_unfinished_requests():
        sim.step()
    assert sim.s.num_preemptions >= 1
    for r, p in zip(reqs, prompts):
        assert r.output_token_ids == reference_output(p, 6)


def test_a_short_prompt_rides_beside_a_long_one_and_the_long_one_takes_the_rest() -> None:
    sim = Sim(num_blocks=200, bs=4, budget=32, max_seqs=8)
    short = Request("short", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True), session_id="tab1")
    sim.s.add_request(short)
    sim.step()  # short is decoding now
    long = Request("long", [1] * 300, SamplingParams(max_tokens=2, ignore_eos=True), session_id="tab2")
    late = Request("late", [3, 3], SamplingParams(max_tokens=2, ignore_eos=True), session_id="tab3")
    sim.s.add_request(long)
    sim.s.add_request(late)
    out = sim.s.schedule()
    chunks = {x.request.request_id: x.num_new_tokens for x in out.scheduled}
    # One step holds the decode, the late short prompt (though it came after the long one)
    # and the long prompt's chunk with the rest of the budget.
    assert chunks == {"short": 1, "late": 2, "long": 32 - 1 - 2}
    sim.s.update_from_output(out, {"short": 0, "late": 0})


def test_long_prompts_are_read_first_come_first_served() -> None:
    """A long prompt is not slowed by long ones sent after it: it takes the whole budget
    until it is read, and the next one starts in the step it ends."""
    sim = Sim(num_blocks=400, bs=4, budget=32, max_seqs=8)
    first = Request("first", [1] * 70, SamplingParams(max_tokens=1), session_id="a")
    sim.s.add_request(first)
    for i in range(3):
        sim.s.add_request(Request(f"next{i}", [2 + i] * 40, SamplingParams(max_tokens=1),
                                  session_id=f"s{i}"))
    steps = []
    while sim.s.has_unfinished_requests():
        out = sim.s.schedule()
        steps.append({x.request.request_id: x.num_new_tokens for x in out.scheduled})
        sim.s.update_from_output(out, {x.request.request_id: 0 for x in out.scheduled
                                       if x.samples})
    assert steps[:3] == [{"first": 32}, {"first": 32}, {"first": 6, "next0": 26}]
    assert steps[3] == {"next0": 14, "next1": 18}


def test_a_follow_up_turn_goes_before_a_long_prompt_being_read() -> None:
    """A waiting request whose prompt is mostly a cached history is short: it is admitted
    before the running long prompt takes the budget."""
    sim = Sim(num_blocks=400, bs=4, budget=32, max_seqs=8)
    history = [5] * 60
    turn1 = Request("turn1", history, SamplingParams(max_tokens=1), session_id="chat")
    sim.s.add_request(turn1)
    while sim.s.has_unfinished_requests():
        sim.step()
    sim.s.add_request(Request("doc", [1] * 300, SamplingParams(max_tokens=1), session_id="doc"))
    sim.step()  # the document is being read, 32 tokens a step
    sim.s.add_request(Request("turn2", history + [6] * 6, SamplingParams(max_tokens=1),
                              session_id="chat"))
    out = sim.s.schedule()
    chunks = {x.request.request_id: x.num_new_tokens for x in out.scheduled}
    # 60 cached tokens (15 blocks), 6 new: all read in this step, the document the rest.
    assert chunks == {"turn2": 6, "doc": 26}


def test_waiting_requests_of_idle_sessions_go_first() -> None:
    sim = Sim(num_blocks=100, bs=4, budget=8, max_seqs=8)
    for i in range(4):
        sim.s.add_request(Request(f"busy{i}", [1] * 2, SamplingParams(max_tokens=2), session_id="busy"))
    sim.s.add_request(Request("other", [2] * 2, SamplingParams(max_tokens=2), session_id="other"))
    first = sim.s.schedule()
    # The idle session's request comes second, ahead of the busy session's older ones.
    assert [x.request.request_id for x in first.scheduled] == ["busy0", "other", "busy1", "busy2"]
    assert all(x.num_new_tokens == 2 for x in first.scheduled)
