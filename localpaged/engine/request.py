"""Requests, their sampling parameters and the outputs the engine returns. No torch here."""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop (names follow vLLM's).

    temperature 0 is greedy. top_k <= 0 (or -1) disables top-k; top_p = 1 and min_p = 0
    disable theirs. `seed` makes a request's samples reproducible whatever else is batched.
    `stop` strings end the answer and are not part of the returned text.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    # An embedding request: the prompt's last-token hidden state (after the final norm),
    # L2-normalized, instead of tokens (decoder embedding models: Qwen3-Embedding's pooling)
    embed: bool = False
    # Constrained output (localpaged.engine.grammar.GrammarSpec: a JSON schema or any JSON)
    grammar: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field whose value is out of range."""
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               "max_tokens", self.max_tokens, "an integer >= 1")
        _check(_finite(self.temperature) and self.temperature >= 0,
               "temperature", self.temperature, "a number >= 0")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(isinstance(self.top_k, int), "top_k", self.top_k, "an integer (<= 0 disables it)")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _check(_finite(self.repetition_penalty) and self.repetition_penalty > 0,
               "repetition_penalty", self.repetition_penalty, "a number > 0")
        _check(_finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
               "presence_penalty", self.presence_penalty, "in [-2, 2]")
        _check(_finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
               "frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        _check(self.seed is None or isinstance(self.seed, int), "seed", self.seed, "an integer")
        _check(all(isinstance(s, str) and s for s in self.stop),
               "stop", self.stop, "a list of non-empty strings")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
               "logprobs", self.logprobs, "an integer in [0, 20]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: expected {expected}")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


_arrival = itertools.count()


class Request:
    """One generation: prompt tokens, generated tokens and the scheduler's view of progress.

    `num_computed_tokens` counts tokens whose K/V is in the cache (cached prefix included);
    `all_token_ids` is prompt + output. `session_id` groups requests of one chat for the
    scheduler's fair share.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        session_id: str | None = None,
        rope_offset: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.session_id = session_id or request_id
        # Added to its positions to index the model's rotary table (LongRoPE: the long
        # factors' rows; model.rope). K/V computed at one offset is not valid at another.
        self.rope_offset = rope_offset
        self.arrival = next(_arrival)
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.num_preemptions = 0
        self.block_hashes: list[int] = []  # hashes of this request's full blocks, in order
        self.stop_reason: int | str | None = None

    @property
    def cache_salt(self) -> bytes:
        """Mixed into its blocks' prefix-cache hashes: requests reading other rotary rows
        (`rope_offset`) never share blocks."""
        return b"" if not self.rope_offset else f"rope+{self.rope_offset}".encode()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, "
                f"{self.status.value})")


@dataclass
class Logprob:
    """Log-probability of a sampled token and the top-N alternatives at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """The generated part of one request's output (vLLM's shape: `.text`, `.token_ids`)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[Logprob] | None = None


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
