"""Continuous batching: which requests run each step and how many tokens each. No torch here.

Every step is one flat batch under a token budget: the decodes of running requests (one
token each) plus prefill chunks of requests still reading their prompt. When the pool runs
out of blocks the latest-arrived running request is preempted (its blocks freed, recomputed
later, largely from the prefix cache). Prompts: short ones (a follow-up turn after its
cached history) go first, so a chat's next turn never waits behind another chat's long
document; long ones are read first come, first served, the oldest taking the budget left, so
a long prompt is not slowed down by the ones sent after it (splitting the budget between
them would delay every one of them). Waiting requests of sessions with fewer running
requests are admitted first, so one busy session cannot starve the other chats.

With a step-time bound (`StepTimeBound`, fed by the engine's measured step timings), a step
that carries decodes cuts its prefill chunks to what fits in the bound, so a streaming chat
does not wait for a long prompt being read; the step's first prefill chunk still gets at
least one block, so prefill always advances. Chunks are then handed out in the order above.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from localpaged.engine.kv_cache import KVCacheManager
from localpaged.engine.request import Request, RequestStatus
from localpaged.engine.step_bound import StepChunks, StepTimeBound
from localpaged.engine.step_cost import StepShape


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 2048
    # A prompt with at most this many tokens left to read is short: it goes before long ones.
    short_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: expected >= 1")
        if self.short_prompt_tokens is None:
            self.short_prompt_tokens = max(1, self.max_num_batched_tokens // 4)


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step's chunk reaches the request's last known token."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting queue and running list; the engine drives it step by step."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 time_bound: StepTimeBound | None = None) -> None:
        self.config = config
        self.kv = kv
        self.time_bound = time_bound
        self.step_target: float | None = None  # seconds, of the last step bounded
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0
        self.num_generated_tokens = 0

    # -- queue management ----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (abort, stop string ...), freeing its blocks now."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        return request

    # -- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch. Never exceeds the token budget or max_num_seqs.

        Order: decodes, then short prompts (at most `short_prompt_tokens` left to read: a
        follow-up turn after its cached history, a quick question), running ones then waiting
        ones, then long prompts first come, first served, the oldest with all the budget
        left. A long prompt read first is not slowed by others sent after it, and a short one
        never waits behind a long one."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        decodes = StepShape()
        for r in self.running:
            if r.num_tokens - r.num_computed_tokens == 1:
                decodes = decodes.with_decode(r.num_tokens)
        chunks = StepChunks(self.time_bound, decodes)
        budget = self._schedule_running(out, budget, chunks, long=False)
        if not out.preempted:
            budget = self._admit_waiting(out, budget, chunks, short_only=True)
            budget = self._schedule_running(out, budget, chunks, long=True)
            self._admit_waiting(out, budget, chunks, short_only=False)
        if chunks.target is not None:
            self.step_target = chunks.target
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, chunks: StepChunks,
                          long: bool) -> int:
        """Schedule the running requests' decodes and short prompt chunks (`long` False), or
        their long prompts' chunks (`long` True). Decodes and short chunks preempt the latest
        admitted requests when the pool runs out of blocks; a long chunk that does not fit
        waits instead (the requests after it may be scheduled already). Returns the budget
        left."""
        scheduled = {s.request.request_id for s in out.scheduled}
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            left = request.num_tokens - request.num_computed_tokens
            prefilling = left > 1  # still reading its prompt
            if (left > self.config.short_prompt_tokens) != long or (
                    long and request.request_id in scheduled):
                i += 1
                continue
            if prefilling:
                self._take_blocks_computed_meanwhile(request)
            start = request.num_computed_tokens
            num_new = min(request.num_tokens - start, budget)
            if prefilling:
                num_new = chunks.size(start, num_new)
                if num_new == 0:  # no time left in this step: it goes on next step
                    i += 1
                    continue
            if long:
                if self.kv.allocate_slots(request, num_new):
                    out.scheduled.append(ScheduledRequest(request, num_new))
                    budget -= num_new
                    chunks.add(start, num_new)
                i += 1
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()  # latest admitted first
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                if prefilling:
                    chunks.add(start, num_new)
                i += 1
                continue
            break  # the request itself was preempted: nothing after it is left running
        return budget

    def _take_blocks_computed_meanwhile(self, request: Request) -> None:
        """Skip the part of a running request's prompt that other requests have computed
        since its last chunk (chats sharing a prefix then compute it once, together)."""
        hits, num_hit = self.kv.get_computed_blocks(request)
        if hits and self.kv.allocate_slots(request, 0, hits):
            request.num_computed_tokens += num_hit
            request.num_cached_tokens += num_hit

    def _admit_waiting(self, out: SchedulerOutput, budget: int, chunks: StepChunks,
                       short_only: bool) -> int:
        """Admit waiting requests (session fair share, then arrival) while the budget, the
        pool and max_num_seqs allow; with `short_only`, only those with a short prompt left
        after their cached prefix (the others keep their place). Returns the budget left."""
        passed: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self._next_waiting()
            if short_only and self._left_after_cache(request) > self.config.short_prompt_tokens:
                passed.append(request)
                continue
            # Sized before the prefix-cache lookup (which counts its queries): a request the
            # step has no time for is not looked up again and again.
            limit = chunks.size(request.num_computed_tokens,
                                min(request.num_tokens - request.num_computed_tokens, budget))
            if limit == 0:
                self.waiting.appendleft(request)
                break
            computed: list = []
            num_cached = 0
            if request.num_computed_tokens == 0:
                computed, num_cached = self.kv.get_computed_blocks(request)
            start = request.num_computed_tokens + num_cached
            num_new = min(request.num_tokens - start, limit)
            if not self.kv.allocate_slots(request, num_new, computed, num_cached):
                # Put it back at the front; the pool frees up as running requests finish.
                self.waiting.appendleft(request)
                break
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens += num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            chunks.add(start, num_new)
        self.waiting.extendleft(reversed(passed))
        return budget

    def _left_after_cache(self, request: Request) -> int:
        """Prompt tokens a waiting request would still compute after its cached prefix
        (looked up without counting it as a query)."""
        left = request.num_tokens - request.num_computed_tokens
        if left <= self.config.short_prompt_tokens or request.num_computed_tokens:
            return left
        return left - self.kv.cached_prefix_tokens(request)

    def _next_waiting(self) -> Request:
        """The waiting request whose session has the fewest running requests (then oldest)."""
        if len(self.waiting) == 1:
            return self.waiting.popleft()
        busy = Counter(r.session_id for r in self.running)
        best = min(self.waiting, key=lambda r: (r.status != RequestStatus.PREEMPTED,
                                                 busy[r.session_id], r.arrival))
        self.waiting.remove(best)
        return best

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, int]
    ) -> list[Request]:
        """Advance the scheduled requests by their chunks, append sampled tokens, and finish
        those that hit EOS, a stop token, max_tokens or the context length. Returns the
        requests finished this step (their blocks already freed)."""
        finished = []
        for s in out.scheduled:
            request = s.request
            if request.is_finished:
                continue
            if request.num_computed_tokens < request.num_prompt_tokens:
                prompt_part = min(s.num_new_tokens,
                                  request.num_prompt_tokens - request.num_computed_tokens)
                self.num_prompt_tokens_computed += prompt_part
            request.num_computed_tokens += s.num_new_tokens
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.append_output_token(token)
            self.num_generated_tokens += 1
            status = self._stop_status(request, token)
            if status is not None:
                self.finish_request(request.request_id, status)
                finished.append(request)
        return finished

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        p = request.params
        if not p.ignore_eos and token in request.eos_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if token in p.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
