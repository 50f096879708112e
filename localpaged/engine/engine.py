"""LLMEngine: the step loop. add_request / step / abort, on one model.

A step = schedule -> one forward pass over a flat batch -> sample -> update requests ->
detokenize new tokens and apply stop strings. Each step is timed: the timings teach the
scheduler's step-cost model (see step_bound.py) and give the inter-token latencies.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from localpaged.engine.client import EngineStats, ModelInfo
from localpaged.engine.config import EngineArgs
from localpaged.engine.kv_cache import KVCacheManager
from localpaged.engine.latency import InterTokenLatency
from localpaged.engine.request import Logprob, Request, RequestStatus, SamplingParams
from localpaged.engine.runner import ModelRunner
from localpaged.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from localpaged.engine.step_bound import AUTO_MULTIPLE, StepTimeBound
from localpaged.engine.step_cost import StepCostModel, StepShape
from localpaged.engine.stop import StopChecker
from localpaged.gc_pause import collector_paused
from localpaged.kernels import check_supported
from localpaged.kernels.backend import use_triton_on
from localpaged.model.optimize import describe as describe_optimizations
from localpaged.model.optimize import optimize_for_inference


@dataclass
class StepOutput:
    """What one step produced for one request: new tokens and the new text they make."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    logprobs: list[Logprob] = field(default_factory=list)
    embedding: list[float] | None = None  # an embedding request's vector (it ends with it)


# A busy engine (requests running back to back) still moves its weights into huge pages, a
# piece (huge_pages.STEP_BYTES) between two steps at most this often.
BUSY_MOVE_EVERY_S = 1.0


class LLMEngine:
    """Continuous batching over one loaded model. Not thread-safe: AsyncEngine drives it
    from one thread."""

    def __init__(self, model: Any, model_config: Any, tokenizer: Any, args: EngineArgs,
                 info: ModelInfo | None = None) -> None:
        self.model = model
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.args = args
        self.device = torch.device(args.resolved_device())
        self.dtype = model.dtype
        c = model_config
        check_supported(c.head_dim, args.block_size, self.dtype, self.device,
                        c.num_heads, c.num_kv_heads)
        self.optimizations = optimize_for_inference(model, self.device)
        if (note := describe_optimizations(self.optimizations)) is not None:
            print(f"localpaged: CPU fast paths: {note}", file=sys.stderr, flush=True)
        kv_dtype = args.resolved_kv_cache_dtype(model, self.device)
        if kv_dtype != model.dtype and use_triton_on(self.device):
            raise ValueError(f"kv_cache_dtype={args.kv_cache_dtype}: the Triton kernels keep the "
                             f"cache in the model's dtype ({str(model.dtype).removeprefix('torch.')});"
                             " leave kv_cache_dtype at auto")
        per_block = model.kv_cache_bytes_per_block(args.block_size, kv_dtype)
        num_blocks = args.num_kv_blocks or max(1, int(args.resolved_kv_cache_gb() * 2**30 // per_block))
        self.kv_bytes = num_blocks * per_block
        max_len = min(c.max_position_embeddings, args.max_model_len or c.max_position_embeddings)
        max_len = min(max_len, num_blocks * args.block_size)  # a lone request always fits
        self.max_model_len = max_len
        self.kv = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching)
        self.step_costs = StepCostModel()
        bound = (None if args.max_step_ms == 0 else
                 StepTimeBound(self.step_costs, args.max_step_ms, args.block_size))
        self.scheduler = Scheduler(
            SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs, max_len), self.kv,
            bound)
        self.itl = InterTokenLatency()
        self.clock: Callable[[], float] = time.perf_counter  # tests give a fake one
        self.runner = ModelRunner(model, num_blocks, args.block_size, self.device, kv_dtype)
        from localpaged.engine.loading import memory_line, resident_bytes, weights_bytes

        self.weights_bytes = weights_bytes(model)
        kv_name = str(kv_dtype).removeprefix("torch.")
        print(f"localpaged: {memory_line(self.weights_bytes, self.kv_bytes, num_blocks * args.block_size, resident_bytes() if self.device.type == 'cpu' else None, kv_name)}",
              file=sys.stderr, flush=True)
        self.info = info or ModelInfo(name=str(args.model))
        self.info.device, self.info.dtype = str(self.device), str(self.dtype).removeprefix("torch.")
        self.info.context_length = max_len
        self.stop_checkers: dict[str, StopChecker] = {}
        self.steps = 0
        self._ids = itertools.count()
        from localpaged.model import huge_pages

        self._mover = (huge_pages.WeightMover(model, getattr(model, "weights_file_mapped", False))
                       if self.device.type == "cpu" and huge_pages.available() else None)
        # A busy engine's first piece comes BUSY_MOVE_EVERY_S after load, not before its
        # first step: the piece (32 MiB into fresh huge pages, the decode plan rebuilt) had
        # delayed the first token by 15-60 ms.
        self._last_move = time.monotonic()

    # -- work between steps ----------------------------------------------------------------
    def idle_work(self, busy: bool = False) -> str:
        """One piece of the work left after load: the weights' move into huge pages
        (model/huge_pages.py). "moved" (call again), "blocked" (the packed-weights writer's
        snapshot still holds the packed tensors, or `busy` and a piece moved less than
        BUSY_MOVE_EVERY_S ago: later), or "done". `busy`: requests are running, so a busy
        engine gets there too, a piece at a time."""
        mover = self._mover
        if mover is None:
            return "done"
        from localpaged.model import packed_cache

        if packed_cache.writing():
            return "blocked"
        if busy and time.monotonic() - self._last_move < BUSY_MOVE_EVERY_S:
            return "blocked"
        mover.step()
        self._last_move = time.monotonic()
        if getattr(self.model, "cpu_decode", None) is not None:  # it points into the weights
            from localpaged.kernels.decode_layer import CpuDecodePlan

            self.model.cpu_decode = CpuDecodePlan.build(self.model)
        if mover.done:
            self._mover = None
            return "done"
        return "moved"

    def drop_idle_work(self) -> None:
        """Leave the work between steps undone (after it failed: the weights stay put)."""
        self._mover = None

    def finish_idle_work(self) -> None:
        """Do all of `idle_work` now (waiting for the packed-weights writer first)."""
        from localpaged.model import packed_cache

        if self._mover is not None:
            packed_cache.wait_for_writes()
        while self.idle_work() != "done":
            pass

    @classmethod
    def from_args(cls, args: EngineArgs) -> LLMEngine:
        """Load the model named by args.model (catalog name, HF folder or .gguf file)."""
        from localpaged.engine.loading import load_model_parts

        with collector_paused():  # thousands of long-lived objects: no collections meanwhile
            model, config, tokenizer, info = load_model_parts(args)
            return cls(model, config, tokenizer, args, info)

    # -- requests ------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give the prompt as token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the problem; nothing is scheduled."""
        params.validate()
        if not prompt_ids:
            raise ValueError("prompt is empty: give at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is too long: {len(prompt_ids)} tokens, the context is "
                f"{self.max_model_len} tokens (prompt + answer must fit)")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is out of range [0, {vocab})")
        if params.grammar is not None:
            self.grammar_backend().compile(params.grammar)  # a bad schema fails here

    def grammar_backend(self) -> Any:
        """The constrained-decoding backend (built at the first constrained request)."""
        if self.runner.grammar is None:
            if self.tokenizer is None:
                raise ValueError("constrained output needs the model's tokenizer")
            from localpaged.engine.grammar import GrammarBackend

            self.runner.grammar = GrammarBackend(self.tokenizer.hf_full, self.model_config.vocab_size)
        return self.runner.grammar

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, session_id: str | None = None) -> Request:
        """Validate and queue a request. Returns it (its id is request.request_id)."""
        params = params or SamplingParams()
        prompt_ids = self.encode_prompt(prompt)
        self.validate(prompt_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        eos = tuple(self.tokenizer.eos_token_ids if self.tokenizer else
                    self.model_config.eos_token_ids or ())
        rope_offset = getattr(self.model, "rope_offset", lambda n: 0)(len(prompt_ids))
        request = Request(request_id, prompt_ids, params, eos, session_id, rope_offset)
        self.scheduler.add_request(request)
        self.stop_checkers[request_id] = StopChecker(self.tokenizer, params.stop)
        return request

    def abort(self, request_id: str) -> bool:
        """Finish a request now and free its blocks. False if it was not running."""
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self._forget(request_id)
        return request is not None

    def _forget(self, request_id: str) -> None:
        self.stop_checkers.pop(request_id, None)
        self.runner.release(request_id)
        self.itl.forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one batch. Returns an output for every request that got a token or finished."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        self.steps += 1
        shape = step_shape(sched)
        started = self.clock()
        sampled, logprobs, embeddings = self.runner.execute(sched, self.kv)
        if self.device.type == "cuda":  # a step that samples nothing returns before the GPU is done
            torch.cuda.synchronize(self.device)
        finished = {r.request_id for r in self.scheduler.update_from_output(sched, sampled)}
        outputs = []
        for rid, vector in embeddings.items():  # read its prompt: done, no token
            r = self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
            if r is not None:
                outputs.append(StepOutput(rid, [], "", True, "stop", r.num_prompt_tokens,
                                          r.num_cached_tokens, 0, [], vector))
        for s in sched.scheduled:
            r = s.request
            rid = r.request_id
            if rid not in sampled:
                continue
            checker = self.stop_checkers[rid]
            text, hit = checker.add(sampled[rid], final=rid in finished)
            if hit is not None and rid not in finished:
                # A stop string ended the answer.
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
                r.stop_reason = hit
                finished.add(rid)
                text += checker.flush()
            out = StepOutput(rid, [sampled[rid]], text, rid in finished,
                             r.status.value if rid in finished else None, r.num_prompt_tokens,
                             r.num_cached_tokens, r.num_output_tokens,
                             [logprobs[rid]] if rid in logprobs else [])
            outputs.append(out)
        now = self.clock()
        self.step_costs.observe(shape, now - started)
        for out in outputs:
            self.itl.token(out.request_id, now)
            if out.finished:
                self._forget(out.request_id)
        return outputs

    def describe_step_bound(self) -> str:
        """The step-time bound in force, for the engine screen."""
        bound = self.scheduler.time_bound
        if bound is None:
            return "off"
        if bound.fixed_target is not None:
            return f"{bound.fixed_target * 1e3:g} ms"
        last = self.scheduler.step_target
        what = f"{AUTO_MULTIPLE:g} x a decode-only step"
        return what if last is None else f"{what} (last {last * 1e3:.1f} ms)"

    def stats(self) -> EngineStats:
        sch, kv = self.scheduler, self.kv
        return EngineStats(
            model=self.info.name, device=str(self.device), num_running=len(sch.running),
            num_waiting=len(sch.waiting), kv_blocks_used=kv.num_used_blocks,
            kv_blocks_total=kv.pool.num_blocks, block_size=kv.block_size,
            prefix_cache_queries=kv.stats.queries, prefix_cache_hits=kv.stats.hits,
            prompt_tokens_total=sch.num_prompt_tokens_computed,
            generation_tokens_total=sch.num_generated_tokens, num_preemptions=sch.num_preemptions,
            steps=self.steps, max_model_len=self.max_model_len,
            inter_token_latency=self.itl.summary(), step_bound=self.describe_step_bound())


def step_shape(out: SchedulerOutput) -> StepShape:
    """The cost model's view of a scheduled batch (before it runs)."""
    shape = StepShape()
    for s in out.scheduled:
        r = s.request
        if r.num_tokens - r.num_computed_tokens == 1:
            shape = shape.with_decode(r.num_tokens)
        else:
            shape = shape.with_chunk(r.num_computed_tokens, s.num_new_tokens)
    return shape
