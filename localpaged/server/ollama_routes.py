"""The Ollama-compatible API: /api/version, tags, show, ps, chat, generate (NDJSON) and pull."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from localpaged.engine.client import Message, StreamDelta
from localpaged.engine.grammar import GrammarSpec
from localpaged.model.thinking import ThinkingSplitter
from localpaged.model.tool_calls import ToolStream
from localpaged.server import embeddings, models_view
from localpaged.server.common import (
    count_chat_tokens,
    count_text_tokens,
    engine_messages,
    fit_max_tokens,
    make_params,
    ollama_grammar,
    stop_list,
    thinking_splitter,
    thinks,
    tool_format,
    tool_messages,
    tool_setup,
)
from localpaged.server.errors import APIError
from localpaged.server.model_leases import bind_model, known, not_found
from localpaged.server.schemas import (
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaModelRequest,
    OllamaOptions,
)
from localpaged.server.streams import Generation, GenerationResponse, ServerState, start_generation

# VS Code Copilot's Ollama provider refuses servers older than 0.6.4.
OLLAMA_VERSION = "0.6.4"

router = APIRouter(prefix="/api", include_in_schema=False)


def _state(request: Request) -> ServerState:
    return request.app.state.localpaged


def now_iso() -> str:
    """Ollama's `created_at`: RFC 3339 with nanosecond-style fraction, UTC."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ndjson(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


def parse_keep_alive(value: str | float | None) -> float | None:
    """keep_alive as seconds (negative: forever); a duration string ("5m", "1h30m", "90s",
    "-1"), a number of seconds, or None for the default. ValueError when malformed."""
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"keep_alive={value!r} is not a finite number")
        return float(value)
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    sign = -1.0 if text.startswith("-") else 1.0
    rest, total, matched = text.lstrip("+-"), 0.0, False
    while rest:
        i = 0
        while i < len(rest) and (rest[i].isdigit() or rest[i] == "."):
            i += 1
        unit = next((u for u in sorted(units, key=len, reverse=True)
                     if rest[i:].startswith(u)), None)
        if i == 0 or unit is None:
            raise ValueError(f"keep_alive={value!r} is not a duration like '5m' or '-1'")
        try:
            total += float(rest[:i]) * units[unit]
        except ValueError:
            raise ValueError(f"keep_alive={value!r} is not a duration like '5m'") from None
        rest, matched = rest[i + len(unit):], True
    if not matched:
        raise ValueError(f"keep_alive={value!r} is not a duration like '5m' or '-1'")
    return sign * total


def _keep_alive(value: str | float | None) -> float | None:
    """A request's keep_alive in seconds (None: the model's default); 400 when malformed."""
    try:
        return parse_keep_alive(value)
    except ValueError as exc:
        raise APIError(400, str(exc), param="keep_alive") from exc


def _params(state: ServerState, options: OllamaOptions | None, prompt_tokens: int | None,
            grammar: GrammarSpec | None = None) -> Any:
    o = options or OllamaOptions()
    num_predict = o.num_predict if o.num_predict is not None and o.num_predict > 0 else None
    max_tokens = fit_max_tokens(state, prompt_tokens, num_predict, strict=False)
    return make_params(
        max_tokens=max_tokens,
        temperature=0.8 if o.temperature is None else o.temperature,
        top_p=0.9 if o.top_p is None else o.top_p,
        top_k=40 if o.top_k is None else o.top_k,
        min_p=o.min_p, seed=o.seed, stop=stop_list(o.stop),
        repetition_penalty=o.repeat_penalty, presence_penalty=o.presence_penalty,
        frequency_penalty=o.frequency_penalty, grammar=grammar)


def _final_fields(gen: Generation, last: StreamDelta) -> dict[str, Any]:
    end = time.perf_counter()
    first = gen.first_token_at or end
    return {"done_reason": last.finish_reason or "stop",
            "total_duration": int((end - gen.arrival) * 1e9),
            "load_duration": 0,
            "prompt_eval_count": last.num_prompt_tokens,
            "prompt_eval_duration": int((first - gen.arrival) * 1e9),
            "eval_count": last.num_output_tokens,
            "eval_duration": int((end - first) * 1e9)}


def _load_reply(model: str, keep_alive: float | None, chat: bool) -> dict[str, Any]:
    """Ollama's answer to a request with nothing to generate: the model loaded, or (with
    keep_alive 0) unloaded."""
    out: dict[str, Any] = {"model": model, "created_at": now_iso()}
    out.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    out.update({"done": True, "done_reason": "unload" if keep_alive == 0 else "load"})
    return out


def _unload(request: Request, model: str, chat: bool) -> dict[str, Any]:
    """keep_alive 0 and nothing to generate: unload `model` once its requests in flight are
    answered (it is not loaded just for that; a model the server was given stays)."""
    state = _state(request)
    if not known(state, model):
        raise not_found(state, model)
    state.pool.unload(model)
    return _load_reply(model, 0, chat)


async def _respond(gen: Generation, request: Request, model: str, stream: bool,
                   chat: bool, splitter: ThinkingSplitter | None = None,
                   think: bool | None = None, calls: ToolStream | None = None) -> Any:
    """The answer as Ollama writes it; a thinking model's block goes to `thinking` (left out
    where the request said `think: false`)."""
    def piece(text: str, thought: str = "") -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "created_at": now_iso()}
        if chat:
            body["message"] = {"role": "assistant", "content": text}
            if thought and think is not False:
                body["message"]["thinking"] = thought
        else:
            body["response"] = text
            if thought and think is not False:
                body["thinking"] = thought
        return body

    def split(text: str, final: bool) -> tuple[str, str]:
        return ("", text) if splitter is None else splitter.feed(text, final=final)

    def with_calls(body: dict[str, Any], found: list[Any]) -> dict[str, Any]:
        if found:
            body["message"]["tool_calls"] = [
                {"function": {"name": c.name, "arguments": c.arguments}} for c in found]
        return body

    if not stream:
        text, last, _ = await gen.collect_until_disconnect(request)
        if last.finish_reason == "error":
            raise APIError(500, f"engine error: {last.error or 'unknown'}")
        if calls is not None:
            content, found = calls.fmt.parse(text)
            return JSONResponse({**with_calls(piece(content), found), "done": True,
                                 **_final_fields(gen, last)})
        thought, answer = split(text, True)
        return JSONResponse({**piece(answer, thought), "done": True, **_final_fields(gen, last)})

    async def lines() -> AsyncIterator[str]:
        async for d in gen.deltas():
            if d.finish_reason == "error":
                yield _ndjson({"error": f"engine error: {d.error or 'unknown'}"})
                return
            if calls is not None:
                shown = calls.feed(d.text)
                if shown:
                    yield _ndjson({**piece(shown), "done": False})
                if d.finished:
                    rest, found = calls.finish()
                    if rest or found:
                        yield _ndjson({**with_calls(piece(rest), found), "done": False})
                    yield _ndjson({**piece(""), "done": True, **_final_fields(gen, d)})
                continue
            thought, answer = split(d.text, d.finished)
            if answer or (thought and think is not False):
                yield _ndjson({**piece(answer, thought), "done": False})
            if d.finished:
                yield _ndjson({**piece(""), "done": True, **_final_fields(gen, d)})

    return GenerationResponse(lines(), gen, "application/x-ndjson")


@router.post("/chat")
async def chat(body: OllamaChatRequest, request: Request) -> Any:
    keep_alive = _keep_alive(body.keep_alive)
    if not body.messages and keep_alive == 0:
        return _unload(request, body.model, chat=True)
    state = await bind_model(request, body.model, keep_alive)
    grammar = ollama_grammar(state, body.format)
    tools, _ = tool_setup(state, body.tools, "auto")
    if not body.messages:
        return _load_reply(body.model, keep_alive, chat=True)
    messages = tool_messages(state, engine_messages(body.messages))
    fmt = tool_format(state)
    if tools is not None and fmt is not None:  # the tools through the template; calls read back from the answer
        ids = state.tokenizer.apply_chat_template(messages, tools=tools)
        gen = await start_generation(state, "ollama", prompt=ids,
                                     params=_params(state, body.options, len(ids), grammar))
        return await _respond(gen, request, body.model, body.stream, chat=True,
                              calls=ToolStream(fmt))
    gen, splitter = await _chat_generation(state, body.model, messages, body.options, body.think,
                                           grammar)
    return await _respond(gen, request, body.model, body.stream, chat=True, splitter=splitter,
                          think=body.think)


async def _chat_generation(state: ServerState, model: str, messages: list[Message],
                           options: OllamaOptions | None, think: bool | None,
                           grammar: GrammarSpec | None = None,
                           ) -> tuple[Generation, ThinkingSplitter | None]:
    """The generation for `messages` through the chat template, and the splitter of its
    thinking: `think: false` renders the template with `enable_thinking` off (Qwen3's switch;
    a template without one thinks anyway, and the thinking is left out of the answer)."""
    if think and not thinks(state):
        raise APIError(400, f"{model!r} does not support thinking", param="think")
    if think is False and thinks(state):
        ids = state.tokenizer.apply_chat_template(messages, enable_thinking=False)
        params = _params(state, options, len(ids), grammar)
        gen = await start_generation(state, "ollama", prompt=ids, params=params)
        splitter = thinking_splitter(state, messages, enable_thinking=False)
        return gen, splitter if grammar is None else None
    params = _params(state, options, count_chat_tokens(state, messages), grammar)
    gen = await start_generation(state, "ollama", messages=messages, params=params)
    # under a grammar the answer is its JSON from the first token: nothing to split
    return gen, thinking_splitter(state, messages) if grammar is None else None


@router.post("/generate")
async def generate(body: OllamaGenerateRequest, request: Request) -> Any:
    keep_alive = _keep_alive(body.keep_alive)
    if not body.prompt and not body.suffix and keep_alive == 0:
        return _unload(request, body.model, chat=False)
    state = await bind_model(request, body.model, keep_alive)
    grammar = ollama_grammar(state, body.format)
    if body.images:
        raise APIError(400, "images are not supported")
    prompt_text = body.prompt or ""
    if body.suffix is not None and body.suffix != "":
        fim = state.tokenizer.fim_ids(prompt_text, body.suffix) if state.tokenizer else None
        if fim is None:
            raise APIError(400, f"{body.model} does not support insert")
        prompt: list[int] = list(fim)
        params = _params(state, body.options, len(prompt))
        gen = await start_generation(state, "ollama", prompt=prompt, params=params)
    elif not prompt_text:
        return _load_reply(body.model, keep_alive, chat=False)
    elif body.raw:
        params = _params(state, body.options, count_text_tokens(state, prompt_text), grammar)
        gen = await start_generation(state, "ollama", prompt=prompt_text, params=params)
    else:
        messages: list[Message] = []
        if body.system:
            messages.append({"role": "system", "content": body.system})
        messages.append({"role": "user", "content": prompt_text})
        gen, splitter = await _chat_generation(state, body.model, messages, body.options,
                                               body.think, grammar)
        return await _respond(gen, request, body.model, body.stream, chat=False,
                              splitter=splitter, think=body.think)
    return await _respond(gen, request, body.model, body.stream, chat=False)


@router.post("/embed")
async def embed(body: OllamaEmbedRequest, request: Request) -> dict[str, Any]:
    state = await bind_model(request, body.model, _keep_alive(body.keep_alive))
    start = time.perf_counter()
    inputs = [body.input] if isinstance(body.input, str) else list(body.input)
    if not inputs:
        raise APIError(400, "input is empty")
    vectors, tokens = await embeddings.embed(state, inputs, dimensions=body.dimensions,
                                             truncate=body.truncate)
    return {"model": body.model, "embeddings": vectors,
            "total_duration": int((time.perf_counter() - start) * 1e9), "load_duration": 0,
            "prompt_eval_count": tokens}


@router.post("/embeddings")
async def embeddings_legacy(body: OllamaEmbeddingsRequest, request: Request) -> dict[str, Any]:
    state = await bind_model(request, body.model, _keep_alive(body.keep_alive))
    if not body.prompt:  # Ollama answers an empty prompt with an empty vector
        return {"embedding": []}
    vectors, _ = await embeddings.embed(state, [body.prompt], truncate=True, param="prompt")
    return {"embedding": vectors[0]}


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": OLLAMA_VERSION}


@router.get("/tags")
async def tags(request: Request) -> dict[str, Any]:
    return {"models": models_view.list_models(_state(request))}


@router.get("/ps")
async def ps(request: Request) -> dict[str, Any]:
    return {"models": models_view.running_models(_state(request))}


@router.post("/show")
async def show(body: OllamaModelRequest, request: Request) -> dict[str, Any]:
    state = _state(request)
    name = body.model_name
    if not name:
        raise APIError(400, "model is required")
    return models_view.show_model(state, name)


@router.post("/pull")
async def pull(body: OllamaModelRequest, request: Request) -> Any:
    state = _state(request)
    name = body.model_name
    if not name:
        raise APIError(400, "model is required")
    progress = models_view.pull_progress(state, name)
    if not body.stream:
        last: dict[str, Any] = {}
        async for line in progress:
            last = line
            if "error" in line:
                raise APIError(line.get("status_code", 500), line["error"])
        return last

    async def lines() -> AsyncIterator[str]:
        async for line in progress:
            line.pop("status_code", None)
            yield _ndjson(line)

    return StreamingResponse(lines(), media_type="application/x-ndjson")
