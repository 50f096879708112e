"""AsyncEngine: the engine loop on a background thread, with one asyncio stream per request.

Callers on the event loop submit requests and aborts through a thread-safe inbox; the engine
thread applies them between steps (so an abort frees its blocks before the next step) and
hands each step's text deltas back to the requests' asyncio queues.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from localpaged.engine.client import EngineStats, Message, ModelInfo, Prompt, StreamDelta
from localpaged.engine.config import EngineArgs
from localpaged.engine.engine import LLMEngine, StepOutput
from localpaged.engine.request import SamplingParams

log = logging.getLogger(__name__)

# An idle engine whose work between steps waits (on the packed-weights writer) looks again
# this often.
IDLE_RETRY_S = 0.1
# The work after load starts once the engine has been idle this long: a request sent at once
# (an editor's, a script's) runs first, alone; a chat's first message takes longer to type.
IDLE_BEFORE_WORK_S = 0.3
# Requests arriving at an idle engine: how long the inbox must stay unchanged before the first
# step, and the longest wait (see AsyncEngine._settle).
SETTLE_QUIET_S = 0.001
SETTLE_MAX_S = 0.01


class RequestStream:
    """Async iterator over one request's StreamDeltas. Closing it early aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[StreamDelta] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self.done = False

    def _put(self, delta: StreamDelta) -> bool:
        """Hand a delta to the consumer's loop (engine thread). False if that loop is gone."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, delta)
        except RuntimeError:  # the consumer's event loop is closed: nobody will read this
            self.done = True
            return False
        return True

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamDelta:
        if self.done:
            raise StopAsyncIteration
        try:
            delta = await self._queue.get()
        except asyncio.CancelledError:
            self.cancel()
            raise
        if delta.finished:
            self.done = True
        return delta

    async def aclose(self) -> None:
        self.cancel()

    def cancel(self) -> None:
        """Abort the request if it is still running (non-blocking)."""
        if not self.done:
            self.done = True
            self._engine.post_abort(self.request_id)

    def __del__(self) -> None:
        if not self.done:
            self._engine.post_abort(self.request_id)


class AsyncEngine:
    """Runs an LLMEngine on a daemon thread; safe to use from any asyncio loop.

    Give it a function that builds the engine rather than a built one where you can: the
    engine is then loaded on its own thread too. On the CPU this matters: libgomp gives each
    thread that runs parallel torch ops its own OpenMP team, and once two teams exist (the
    loading thread's and the engine thread's) it stops spin-waiting at barriers, which made
    every decode step about 1.5x slower on a 2-core machine.
    """

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine]) -> None:
        self._inbox: deque[tuple[str, Any]] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._closed = False
        self.idle_work_done = threading.Event()  # set once the weights are in huge pages
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                self.engine = engine() if callable(engine) else engine
                self._stats = self.engine.stats()
            except BaseException as exc:  # handed to the constructor's caller
                failure.append(exc)
                return
            finally:
                ready.set()
            self._run()

        self._thread = threading.Thread(target=run, name="localpaged-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]

    # -- caller side ---------------------------------------------------------------------
    def generate(self, prompt: Prompt, params: SamplingParams, *, request_id: str | None = None,
                 session_id: str | None = None) -> RequestStream:
        """Validate (ValueError now, nothing scheduled) and submit; returns the stream."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        prompt_ids = self.engine.encode_prompt(prompt)
        self.engine.validate(prompt_ids, params)
        request_id = request_id or f"req-{uuid.uuid4().hex[:12]}"
        stream = RequestStream(self, request_id)
        self._post(("add", (prompt_ids, params, request_id, session_id, stream)))
        return stream

    def post_abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def close(self) -> None:
        self._closed = True
        self._post(("close", None))
        self._thread.join(timeout=10)

    def _post(self, item: tuple[str, Any]) -> None:
        self._inbox.append(item)
        self._wake.set()

    # -- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if not self._drain_inbox():
                return
            if not self.engine.has_unfinished_requests():
                self._stats = self.engine.stats()
                self._idle()
                self._wake.clear()
                self._settle()
                continue
            self._idle_work(busy=True)
            try:
                outputs = self.engine.step()
            except Exception as exc:  # keep serving: fail what was running, not the engine
                log.exception("engine step failed")
                self._fail_all(f"engine error: {exc}")
                continue
            for out in outputs:
                self._deliver(out)
            self._stats = self.engine.stats()

    def _idle(self) -> None:
        """Wait to be woken; meanwhile, once idle for IDLE_BEFORE_WORK_S, the engine's work
        left after load, a piece at a time (`LLMEngine.idle_work`: the weights' move into
        huge pages)."""
        if not self.idle_work_done.is_set() and self._wake.wait(IDLE_BEFORE_WORK_S):
            return
        while not self._wake.is_set():
            state = self._idle_work()
            if state == "done":
                self._wake.wait()
            elif state == "blocked":
                self._wake.wait(IDLE_RETRY_S)

    def _idle_work(self, busy: bool = False) -> str:
        if self.idle_work_done.is_set():
            return "done"
        try:
            state = self.engine.idle_work(busy)
        except Exception:  # the weights stay where they are; the engine goes on
            log.exception("work between steps failed")
            state = "done"
            self.engine.drop_idle_work()
        if state == "done":
            self.idle_work_done.set()
        return state

    def _settle(self) -> None:
        """Wait, after an idle engine is woken, until the inbox stops growing (SETTLE_QUIET_S
        without a new item, SETTLE_MAX_S at most). Requests sent together (a client's batch,
        several tabs) arrive microseconds apart; without the wait the first step took the
        first one alone and the others' prompts were read beside its decodes, in chunks the
        step-time bound keeps small (8 prompts at once on a 1.7B model: 46 against 63 tok/s)."""
        deadline = time.monotonic() + SETTLE_MAX_S
        seen = len(self._inbox)
        while time.monotonic() < deadline:
            time.sleep(SETTLE_QUIET_S)
            if len(self._inbox) == seen:
                return
            seen = len(self._inbox)

    def _drain_inbox(self) -> bool:
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "close":
                self._fail_all("the engine was closed", reason="abort")
                return False
            if kind == "add":
                prompt_ids, params, request_id, session_id, stream = item
                try:
                    self.engine.add_request(prompt_ids, params, request_id=request_id,
                                            session_id=session_id)
                except ValueError as exc:
                    stream._put(StreamDelta(request_id, finished=True, finish_reason="error",
                                            error=str(exc)))
                    continue
                self._streams[request_id] = stream
            elif kind == "abort" and self.engine.abort(item):
                stream = self._streams.pop(item, None)
                if stream is not None:
                    stream._put(StreamDelta(item, finished=True, finish_reason="abort"))
        self._stats = self.engine.stats()
        return True

    def _deliver(self, out: StepOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        delivered = stream._put(StreamDelta(
            out.request_id, out.new_text, out.new_token_ids, out.finished, out.finish_reason,
            out.num_prompt_tokens, out.num_cached_tokens, out.num_output_tokens,
            out.logprobs or None, embedding=out.embedding))
        if not delivered and not out.finished:
            self.engine.abort(out.request_id)
            self._streams.pop(out.request_id, None)

    def _fail_all(self, message: str, reason: str = "error") -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            stream._put(StreamDelta(request_id, finished=True, finish_reason=reason,
                                    error=message if reason == "error" else None))
        self._streams.clear()


class LocalClient:
    """EngineClient over the in-process engine."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine]) -> None:
        """`engine`: a built LLMEngine, or a function building one on the engine thread."""
        self.async_engine = AsyncEngine(engine)
        engine = self.engine = self.async_engine.engine
        self.tokenizer = engine.tokenizer
        self.model_info: ModelInfo = engine.info
        self.model_name = engine.info.name

    @classmethod
    def from_model(cls, model: str, **engine_args: Any) -> LocalClient:
        """Load `model` (catalog name, HF folder or .gguf file) and start the engine."""
        args = EngineArgs(model=model, **engine_args)  # bad arguments fail here, at once
        return cls(lambda: LLMEngine.from_args(args))

    def generate(self, prompt: Prompt, params: SamplingParams, *, request_id: str | None = None,
                 session_id: str | None = None) -> RequestStream:
        return self.async_engine.generate(prompt, params, request_id=request_id,
                                          session_id=session_id)

    def chat(self, messages: list[Message], params: SamplingParams, *,
             request_id: str | None = None, session_id: str | None = None) -> RequestStream:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate(ids, params, request_id=request_id, session_id=session_id)

    async def embed(self, prompt: Prompt, *, request_id: str | None = None
                    ) -> tuple[list[float], int]:
        """The normalized last-token hidden state of `prompt` (an embedding model's vector)
        and the prompt's token count. It is scheduled with the chats, in the same steps, and a
        cached prefix serves it too. Raises ValueError for a bad prompt, RuntimeError when the
        engine fails it."""
        stream = self.generate(prompt, SamplingParams(max_tokens=1, embed=True),
                               request_id=request_id)
        async for delta in stream:
            if delta.finished:
                if delta.embedding is None:
                    raise RuntimeError(delta.error or f"embedding ended: {delta.finish_reason}")
                return delta.embedding, delta.num_prompt_tokens
        raise RuntimeError("the engine ended the embedding request without a vector")

    async def abort(self, request_id: str) -> None:
        self.async_engine.post_abort(request_id)

    def stats(self) -> EngineStats:
        return self.async_engine.stats()

    async def close(self) -> None:
        await asyncio.to_thread(self.async_engine.close)
