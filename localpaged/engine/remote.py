"""`RemoteClient`: the `EngineClient` interface over OpenAI's HTTP protocol.

`localpaged chat --remote URL` talks to any OpenAI-compatible server (vLLM, SGLang, another
localpaged) through it, and `chat` attaches to a running localpaged server the same way.
Token ids are not known here: a remote tab keeps messages, and the server does its own prefix
caching. Failures (server down, HTTP errors, bad streams) never raise out of a stream: it ends
with finish_reason "error" and a message, so only the tab that asked sees them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from localpaged.engine.client import EngineStats, Message, Prompt, StreamDelta
from localpaged.engine.request import SamplingParams


class RemoteClient:
    """An OpenAI-compatible server as an engine client. `base_url` ends in /v1 (added if not)."""

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None,
                 *, timeout: float = 600.0, transport: httpx.AsyncBaseTransport | None = None
                 ) -> None:
        url = base_url.rstrip("/")
        if not url.endswith("/v1"):
            url += "/v1"
        self.base_url = url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=url, headers=headers, transport=transport,
                                       timeout=httpx.Timeout(timeout, connect=5.0))
        self._model = model
        self._responses: dict[str, httpx.Response | None] = {}
        self._aborted: set[str] = set()
        self._generated = 0
        self._prompt_tokens = 0
        self._cached_tokens = 0

    @property
    def model_name(self) -> str:
        return self._model or "remote"

    @property
    def host(self) -> str:
        return urlsplit(self.base_url).netloc

    async def resolve_model(self) -> str:
        """The model to ask for: the one given, else the server's first listed model."""
        if self._model is None:
            resp = await self._http.get("/models")
            resp.raise_for_status()
            data = resp.json().get("data") or []
            if not data:
                raise RuntimeError("the server lists no models")
            self._model = str(data[0]["id"])
        return self._model

    def chat(self, messages: list[Message], params: SamplingParams, *,
             request_id: str | None = None, session_id: str | None = None
             ) -> AsyncIterator[StreamDelta]:
        if not messages:
            raise ValueError("messages must not be empty")
        return self._stream("/chat/completions", {"messages": messages}, params, request_id)

    def generate(self, prompt: Prompt, params: SamplingParams, *,
                 request_id: str | None = None, session_id: str | None = None
                 ) -> AsyncIterator[StreamDelta]:
        if not prompt:
            raise ValueError("prompt must not be empty")
        return self._stream("/completions", {"prompt": prompt}, params, request_id)

    async def abort(self, request_id: str) -> None:
        if request_id in self._responses:
            self._aborted.add(request_id)
            resp = self._responses.get(request_id)
            if resp is not None:
                await resp.aclose()

    def stats(self) -> EngineStats:
        return EngineStats(model=self.model_name, device=f"remote {self.host}",
                           num_running=len(self._responses),
                           prefix_cache_queries=self._prompt_tokens,
                           prefix_cache_hits=self._cached_tokens,
                           generation_tokens_total=self._generated)

    async def close(self) -> None:
        await self._http.aclose()

    async def _stream(self, path: str, body: dict[str, Any], params: SamplingParams,
                      request_id: str | None) -> AsyncIterator[StreamDelta]:
        rid = request_id or f"remote-{uuid.uuid4().hex[:12]}"
        self._responses[rid] = None
        try:
            async for delta in self._run(path, body, params, rid):
                yield delta
                if delta.finished:
                    return
            yield StreamDelta(rid, finished=True,
                              finish_reason="abort" if rid in self._aborted else "stop")
        finally:
            self._responses.pop(rid, None)
            self._aborted.discard(rid)

    async def _run(self, path: str, body: dict[str, Any], params: SamplingParams,
                   rid: str) -> AsyncIterator[StreamDelta]:
        try:
            payload = {**body, **_openai_params(params), "model": await self.resolve_model(),
                       "stream": True, "stream_options": {"include_usage": True}}
            async with self._http.stream("POST", path, json=payload) as resp:
                self._responses[rid] = resp
                if resp.status_code >= 400:
                    text = (await resp.aread()).decode(errors="replace")
                    yield _error(rid, f"HTTP {resp.status_code}: {_error_message(text)}")
                    return
                turn = _Turn()
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    delta = self._parse(rid, json.loads(data), turn)
                    if delta is not None:
                        yield delta
                        if delta.finished:
                            return
                if turn.finish is not None or turn.output:
                    yield StreamDelta(rid, finished=True, finish_reason=turn.finish or "stop",
                                      num_prompt_tokens=turn.prompt, num_cached_tokens=turn.cached,
                                      num_output_tokens=turn.output)
        except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as exc:
            if rid in self._aborted:
                return
            yield _error(rid, f"{self.base_url}: {type(exc).__name__}: {exc}".rstrip(": "))

    def _parse(self, rid: str, chunk: dict[str, Any], turn: _Turn) -> StreamDelta | None:
        if "error" in chunk:
            return _error(rid, _error_message(json.dumps(chunk)))
        usage = chunk.get("usage") or {}
        if usage:
            turn.prompt = int(usage.get("prompt_tokens") or 0)
            turn.cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            turn.output = int(usage.get("completion_tokens") or 0)
            self._prompt_tokens += turn.prompt
            self._cached_tokens += turn.cached
        text = ""
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            # a thinking model's reasoning (localpaged, vLLM, DeepSeek: reasoning_content;
            # newer vLLM: reasoning) comes back as the block the model wrote
            thought = delta.get("reasoning_content") or delta.get("reasoning") or ""
            content = delta.get("content") or choice.get("text") or ""
            if thought:
                text += ("" if turn.thinking else "<think>\n") + thought
                turn.thinking = True
            if content and turn.thinking:
                text += "\n</think>\n\n"
                turn.thinking = False
            text += content
            if choice.get("finish_reason"):
                turn.finish = "length" if choice["finish_reason"] == "length" else "stop"
        if not text:
            return None
        self._generated += 1
        return StreamDelta(rid, text=text)


@dataclass
class _Turn:
    """What one streamed answer reported so far."""

    prompt: int = 0
    cached: int = 0
    output: int = 0
    finish: str | None = None
    thinking: bool = False  # inside a reasoning block


def _openai_params(p: SamplingParams) -> dict[str, Any]:
    out: dict[str, Any] = {"max_tokens": p.max_tokens, "temperature": p.temperature,
                           "top_p": p.top_p}
    if p.seed is not None:
        out["seed"] = p.seed
    if p.stop:
        out["stop"] = p.stop
    if p.presence_penalty:
        out["presence_penalty"] = p.presence_penalty
    if p.frequency_penalty:
        out["frequency_penalty"] = p.frequency_penalty
    return out


def _error(rid: str, message: str) -> StreamDelta:
    return StreamDelta(rid, finished=True, finish_reason="error", error=message)


def _error_message(text: str) -> str:
    """The `error.message` of an OpenAI-style error body, else the body itself (shortened)."""
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    except (ValueError, AttributeError):
        pass
    return text.strip()[:300] or "no details"
