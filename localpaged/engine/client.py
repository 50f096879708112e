"""The one interface the chat UI, the HTTP API and `--remote` share.

`LocalClient` (in `async_engine.py`) runs the in-process engine; a remote client speaks
OpenAI's protocol to another server. Both yield `StreamDelta`s.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from localpaged.engine.latency import LatencySummary
from localpaged.engine.request import Logprob, SamplingParams
from localpaged.model.info import ModelInfo

__all__ = ["EngineClient", "EngineStats", "Message", "ModelInfo", "Prompt", "StreamDelta"]

Prompt = str | list[int]
Message = dict[str, Any]


@dataclass
class StreamDelta:
    """One piece of a streamed answer. `text` is new text only; stop strings never appear.
    The last delta has `finished=True` and a `finish_reason` ("stop", "length", "abort" or
    "error", with `error` set)."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[Logprob] | None = None
    error: str | None = None
    embedding: list[float] | None = None  # the answer to an embedding request


@dataclass
class EngineStats:
    """A snapshot of the engine for status lines, /metrics and /api/ps."""

    model: str
    device: str
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    block_size: int = 16
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found cached
    prompt_tokens_total: int = 0  # prompt tokens computed (not cached)
    generation_tokens_total: int = 0
    num_preemptions: int = 0
    steps: int = 0
    max_model_len: int = 0
    inter_token_latency: LatencySummary = field(default_factory=LatencySummary)
    step_bound: str = "unknown"  # the step-time bound in force, in words (remote: unknown)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@runtime_checkable
class EngineClient(Protocol):
    """What a chat tab or an API handler needs from an engine, local or remote."""

    model_name: str

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Stream the completion of a raw prompt (text or token ids). Validation errors
        (empty prompt, prompt longer than the context, bad params) raise ValueError before
        anything is scheduled. Leaving the iterator early (or cancelling its task) aborts
        the request and frees its KV blocks."""
        ...

    def chat(
        self,
        messages: list[Message],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Like `generate`, on messages rendered through the model's chat template."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request now; its stream ends with finish_reason "abort"."""
        ...

    def stats(self) -> EngineStats:
        """Current engine counters."""
        ...

    async def close(self) -> None:
        """Stop the engine (or the connection) and release its resources."""
        ...

