"""The step-time bound: how long a prefill chunk may be in a step that carries decodes.

A chat that is streaming waits for every step its tokens ride in, so a step carrying decodes
gets a time target and its prefill chunks are cut to what the learned cost model says fits.
Steps with no decodes are not bounded: a lone long prompt keeps the whole token budget.

Default target (`max_step_ms=None`): AUTO_MULTIPLE = 2 x what a step of the same decodes
alone costs, so the prompt gets one decode step's worth of time per step, and never less than
AUTO_FLOOR_S = 100 ms. Why the floor: on a CPU a step of one block of prompt beside a decode
already costs 2.5-8 decode steps (the layers' fixed part, and attention over the prompt's
context: 11-14 ms at context 0, 37-39 ms at 2000, against a 4.5-5 ms decode step for SmolLM2
on 2 cores), so a target of 2 decode steps holds every step to that one block, and a long
prompt read beside a stream took 3x as long to answer as alone while the stream still had
45 ms gaps (benchmarks/tab_stall.py: B's TTFT 3.15x, throughput 0.55x, A's p99 gap 44 ms).
At 100 ms: B 1.6x, throughput 0.85x, A's p99 gap 125 ms. A token every 100 ms is 10 tokens
a second, faster than anyone reads (4-7), so the stream never visibly stalls; below that
each millisecond the stream gains costs the prompt being read more than it is worth. Where a
decode step is short and a block of prompt cheap (a GPU), 2 decode steps is below the floor
too: the prompt's chunks then grow to what 100 ms holds, at most the token budget.

Where the decodes cost more in a step that reads a prompt than in a step of their own (on
the CPU the decode rows run their native call per layer in both, but the prompt's chunks
run the torch layers, whose fixed part a step pays whatever the chunk; without the native
decode plan the rows run those layers too), the target is that dearer step, before its prompt
tokens, plus the prompt's decode step of time: no chunk size avoids the fixed part, and
without the extra step the prompt would read one block a step at its full cost. The fixed
part comes from the prefill fit; until chunks of several sizes are measured it is about a
one-block step (the fit's slopes stay near 0), so noise in it is not amplified.
`max_step_ms` > 0 sets a fixed target instead; 0 turns the bound off.
"""

from __future__ import annotations

from typing import Protocol

from localpaged.engine.step_cost import StepShape

AUTO_MULTIPLE = 2.0
AUTO_FLOOR_S = 0.1


class StepCosts(Protocol):
    """What the bound asks of a cost model (StepCostModel; tests give fakes)."""

    mixed_prefill_seen: int  # the most prompt tokens measured in a step with decodes

    def predict(self, shape: StepShape) -> float | None: ...

    def decode_step(self, shape: StepShape) -> float | None: ...

    def prefill_base(self, shape: StepShape) -> float | None: ...


class StepTimeBound:
    """Sizes the prefill chunks of steps that carry decodes, from a step-cost model."""

    def __init__(self, costs: StepCosts, max_step_ms: float | None, min_chunk: int,
                 floor_s: float = AUTO_FLOOR_S) -> None:
        if max_step_ms is not None and not max_step_ms > 0:
            raise ValueError(f"max_step_ms={max_step_ms} is invalid: expected > 0 or None (auto)")
        self.costs = costs
        self.fixed_target = None if max_step_ms is None else max_step_ms / 1e3
        self.min_chunk = min_chunk
        self.floor_s = floor_s  # the automatic target's least value

    def target(self, decodes: StepShape) -> float | None:
        """Seconds a step carrying `decodes` and prompt chunks may take; None while nothing
        is known yet."""
        if self.fixed_target is not None:
            return self.fixed_target
        alone = self.costs.decode_step(decodes)
        if alone is None:
            return None
        base = self.costs.prefill_base(decodes)
        share = (AUTO_MULTIPLE - 1) * alone  # the prompt's time in the step
        return max(AUTO_MULTIPLE * alone, (base or 0.0) + share, self.floor_s)

    def chunk(self, shape: StepShape, start: int, limit: int, target: float | None,
              first: bool) -> int:
        """Tokens (<= limit) of a prompt at position `start` to add to a step of `shape`.

        The longest chunk predicted to keep the step within `target`. The step's first chunk
        gets at least one block (min_chunk) whatever the prediction, so prefill always
        advances; a later chunk that cannot have one block within the target gets 0.

        A step's prompt tokens grow at most 2x past the most measured beside decodes (one
        block, two, four ...): the first steps of prompt reading seen are often too few to
        tell a step's fixed cost from its cost per token, and a wrong guess must not be a
        500-token stall."""
        ramp = max(self.min_chunk, 2 * self.costs.mixed_prefill_seen) - shape.prefill_tokens
        limit = min(limit, ramp if not first else max(ramp, self.min_chunk))
        if limit <= 0:
            return 0
        floor = min(self.min_chunk, limit)
        if target is None or self.costs.predict(shape.with_chunk(start, floor)) is None:
            return floor if first else 0  # nothing learned yet: probe with one block
        lo, hi = 0, limit  # the longest chunk that fits is in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            cost = self.costs.predict(shape.with_chunk(start, mid))
            if cost is not None and cost <= target:
                lo = mid
            else:
                hi = mid - 1
        if lo >= floor:
            return lo
        return floor if first else 0


class StepChunks:
    """The prefill chunks of one step being scheduled: what the step holds so far and
    whether a chunk was given yet. Without a bound, or without decodes, a chunk is its limit."""

    def __init__(self, bound: StepTimeBound | None, decodes: StepShape) -> None:
        self.bound = bound if decodes.decodes else None
        self.shape = decodes
        self.target: float | None = None  # seconds, once a chunk was sized
        self.first = True

    def size(self, start: int, limit: int) -> int:
        """Tokens for a chunk at position `start` that the token budget allows `limit` of."""
        if self.bound is None:
            return limit
        if self.first:  # a step of decodes only never asks
            self.target = self.bound.target(self.shape)
        return self.bound.chunk(self.shape, start, limit, self.target, self.first)

    def add(self, start: int, tokens: int) -> None:
        self.shape = self.shape.with_chunk(start, tokens)
        self.first = False
