"""Running one generation for an HTTP request: the queue cap, errors before the first token,
latency metrics, and the abort that frees the request's KV blocks when the client goes away."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from localpaged.engine.client import EngineClient, Message, Prompt, StreamDelta
from localpaged.engine.model_pool import LoadedModel, ModelPool
from localpaged.engine.request import SamplingParams
from localpaged.server.errors import APIError
from localpaged.server.metrics import ServerMetrics


@dataclass
class ServerState:
    """What the routes share: the pool of loaded models, limits and metrics. A request's copy
    is bound to the model it names (`bind`): `client` is that model's engine client."""

    pool: ModelPool
    max_queued: int
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    started: float = field(default_factory=time.time)
    # names the server may load on demand (the store's registered models); None: none
    loadable: Callable[[], list[str]] | None = None
    model: LoadedModel | None = None  # the model this copy is bound to

    def bind(self, model: LoadedModel) -> ServerState:
        """This state bound to `model` (metrics and limits shared)."""
        return replace(self, model=model)

    @property
    def client(self) -> EngineClient:
        """The bound model's engine client."""
        if self.model is None:
            raise RuntimeError("this server state is not bound to a model")
        return self.model.client

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer, or None for a client without one (a remote engine)."""
        return getattr(self.client, "tokenizer", None)

    def context_length(self) -> int:
        """Tokens of context the engine accepts (prompt + answer); 0 when unknown."""
        try:
            n = int(self.client.stats().max_model_len or 0)
        except Exception:
            n = 0
        info = getattr(self.client, "model_info", None)
        return n or int(getattr(info, "context_length", 0) or 0)


@dataclass
class Generation:
    """One engine request in flight. Iterate `deltas()`; `close()` (idempotent) aborts it if it
    has not finished, closes the engine stream and releases its place in the queue."""

    state: ServerState
    stream: AsyncIterator[StreamDelta]
    first: StreamDelta | None
    request_id: str
    api: str
    arrival: float
    finished: bool = False
    finish_reason: str | None = None
    first_token_at: float | None = None
    _closed: bool = False
    _last: float | None = None

    async def deltas(self) -> AsyncIterator[StreamDelta]:
        """The deltas of the answer, the already fetched first one included."""
        try:
            if self.first is not None:
                first, self.first = self.first, None
                self._observe(first)
                yield first
                if first.finished:
                    return
            async for delta in self.stream:
                self._observe(delta)
                yield delta
                if delta.finished:
                    return
        finally:
            await self.close()

    def _observe(self, delta: StreamDelta) -> None:
        now = time.perf_counter()
        if delta.text or delta.token_ids:
            if self._last is None:
                self.first_token_at = now
                self.state.metrics.ttft.observe(now - self.arrival)
            self._last = now
        if delta.finished:
            self.finished = True
            self.finish_reason = delta.finish_reason

    async def collect(self) -> tuple[str, StreamDelta, list[StreamDelta]]:
        """Run to the end: the whole text, the last delta and all deltas."""
        deltas = [d async for d in self.deltas()]
        return "".join(d.text for d in deltas), deltas[-1], deltas

    async def collect_until_disconnect(
            self, request: Request) -> tuple[str, StreamDelta, list[StreamDelta]]:
        """`collect()`, but abort the request as soon as the client disconnects (then raise
        ClientDisconnect: there is nobody to answer)."""
        result: tuple[str, StreamDelta, list[StreamDelta]] | None = None
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                result = await self.collect()
            finally:
                tg.cancel_scope.cancel()
        if result is None:
            await self.close()
            raise ClientDisconnect()
        return result

    async def close(self) -> None:
        """Abort (if unfinished) and close the engine stream; release the queue slot."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            try:
                if not self.finished:
                    await self.state.client.abort(self.request_id)
            finally:
                aclose = getattr(self.stream, "aclose", None)
                try:
                    if aclose is not None:
                        await aclose()
                finally:
                    self.state.metrics.in_flight -= 1
                    self.state.metrics.count_request(
                        self.api, self.finish_reason or ("abort" if not self.finished else "stop"))


async def start_generation(state: ServerState, api: str, *, prompt: Prompt | None = None,
                           messages: list[Message] | None = None, params: SamplingParams,
                           session_id: str | None = None,
                           prompt_param: str = "prompt") -> Generation:
    """Submit a request and wait for its first delta, so that a refused request (queue full,
    prompt too long, bad parameters) becomes a 4xx before any response byte is sent."""
    metrics = state.metrics
    if metrics.in_flight >= state.max_queued:
        metrics.rejected_total += 1
        raise APIError(429, f"too many requests in flight ({state.max_queued}); retry later",
                       code="queue_full")
    metrics.in_flight += 1
    request_id = f"req-{uuid.uuid4().hex}"
    gen = Generation(state, _empty(), None, request_id, api, time.perf_counter())
    try:
        if messages is not None:
            gen.stream = aiter(state.client.chat(messages, params, request_id=request_id,
                                                 session_id=session_id))
        else:
            assert prompt is not None
            gen.stream = aiter(state.client.generate(prompt, params, request_id=request_id,
                                                     session_id=session_id))
        gen.first = await anext(gen.stream)
    except ValueError as exc:
        gen.finished = True
        gen.finish_reason = "invalid"
        await gen.close()
        raise APIError(400, str(exc), param=_param_of(str(exc), prompt_param),
                       code="invalid_request") from exc
    except RuntimeError as exc:  # e.g. the engine was closed
        gen.finished = True
        gen.finish_reason = "unavailable"
        await gen.close()
        raise APIError(503, f"the engine is not available: {exc}") from exc
    except StopAsyncIteration:
        gen.finished = True
        await gen.close()
        raise APIError(503, "the engine ended the request without an answer") from None
    except BaseException:
        await gen.close()
        raise
    if gen.first.finished and gen.first.finish_reason == "error":
        gen.finished = True
        gen.finish_reason = "error"
        await gen.close()
        raise APIError(500, f"engine error: {gen.first.error or 'unknown'}")
    return gen


def _param_of(message: str, prompt_param: str) -> str | None:
    """The request field an engine validation message is about ("top_p=0 is invalid ...",
    "prompt is too long ...")."""
    head = message.split("=", 1)[0]
    if "=" in message and head.isidentifier():
        return head
    return prompt_param if message.startswith("prompt") else None


async def _empty() -> AsyncIterator[StreamDelta]:
    return
    yield  # pragma: no cover


class GenerationResponse(StreamingResponse):
    """A streamed answer that closes (and so aborts) its generation however the response ends:
    finished, client disconnected, or server shutting down."""

    def __init__(self, content: AsyncIterator[str], generation: Generation,
                 media_type: str) -> None:
        super().__init__(content, media_type=media_type,
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.generation.close()
