"""The OpenAI-compatible API: /v1/models, /v1/chat/completions, /v1/completions (with FIM)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from localpaged.engine.client import StreamDelta
from localpaged.model.thinking import ThinkingSplitter
from localpaged.model.tool_calls import ToolCall, ToolFormat, ToolStream
from localpaged.server import embeddings, models_view
from localpaged.server.common import (
    count_chat_tokens,
    count_text_tokens,
    engine_messages,
    fit_max_tokens,
    make_params,
    openai_grammar,
    stop_list,
    thinking_splitter,
    token_text,
    tool_format,
    tool_messages,
    tool_setup,
)
from localpaged.server.errors import APIError, error_body
from localpaged.server.model_leases import bind_model, known, not_found
from localpaged.server.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    EmbeddingRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from localpaged.server.streams import Generation, GenerationResponse, ServerState, start_generation

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text} for code, text in (
        (400, "malformed JSON, wrong types, bad or unsupported values, context overflow"),
        (401, "missing or wrong bearer key (when the server has one)"),
        (403, "foreign Host or Origin"), (404, "unknown model"), (413, "body too large"),
        (429, "too many requests in flight"))}
_SSE = {"text/event-stream": {"schema": {"type": "string"}}}

router = APIRouter(prefix="/v1", tags=["OpenAI"], responses=_ERRORS)


def _state(request: Request) -> ServerState:
    return request.app.state.localpaged


def _usage(last: StreamDelta) -> dict[str, Any]:
    return {"prompt_tokens": last.num_prompt_tokens,
            "completion_tokens": last.num_output_tokens,
            "total_tokens": last.num_prompt_tokens + last.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": last.num_cached_tokens}}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _check_common(body: ChatCompletionRequest | CompletionRequest) -> None:
    if body.n not in (None, 1):
        raise APIError(400, f"n={body.n} is not supported: only n=1", param="n")


@router.get("/models", summary="List the models requests may name (loaded ones first)",
            response_model=ModelList)
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list",
            "data": [{"id": name, "object": "model", "created": int(created),
                      "owned_by": "localpaged"}
                     for name, created in models_view.model_ids(_state(request))]}


@router.get("/models/{model:path}", summary="Describe a model", response_model=ModelCard)
async def get_model(model: str, request: Request) -> dict[str, Any]:
    state = _state(request)
    if not known(state, model):
        raise not_found(state, model)
    created = dict(models_view.model_ids(state)).get(model, state.started)
    return {"id": model, "object": "model", "created": int(created), "owned_by": "localpaged"}


def _chat_logprobs(state: ServerState, delta: StreamDelta) -> dict[str, Any] | None:
    if delta.logprobs is None:
        return None
    content = []
    for lp in delta.logprobs:
        tok = token_text(state, lp.token_id)
        top = []
        for tid, val in lp.top:
            t = token_text(state, tid)
            top.append({"token": t, "logprob": val, "bytes": list(t.encode())})
        content.append({"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode()),
                        "top_logprobs": top})
    return {"content": content}


def _merge_chat_logprobs(parts: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    present = [p for p in parts if p is not None]
    if not present:
        return None
    return {"content": [c for p in present for c in p["content"]]}


@router.post("/chat/completions", summary="Chat completion (SSE with `stream: true`)",
             responses={200: {"model": ChatCompletion, "content": _SSE}})
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    _check_common(body)
    state = await bind_model(request, body.model)
    tools, call_grammar = tool_setup(state, body.tools, body.tool_choice)
    grammar = openai_grammar(state, body.response_format)
    if grammar is not None and call_grammar is not None:
        raise APIError(400, "a forced tool call and response_format cannot both hold",
                       param="tool_choice")
    grammar = grammar or call_grammar
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    messages = tool_messages(state, engine_messages(body.messages))
    prompt_ids = None
    if tools is not None:  # the tools through the template: the prompt is rendered here
        try:
            prompt_ids = state.tokenizer.apply_chat_template(messages, tools=tools)
        except Exception as exc:
            raise APIError(400, f"the model's chat template rejected the tools: {exc}",
                           param="tools") from exc
    prompt_tokens = len(prompt_ids) if prompt_ids is not None else count_chat_tokens(state, messages)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = fit_max_tokens(state, prompt_tokens, requested, strict=True, param=param)
    params = make_params(
        max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
        stop=stop_list(body.stop), presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, top_k=body.top_k, min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None, grammar=grammar)
    # a thinking model's block apart (not under a grammar: the answer is its JSON from the
    # first token)
    splitter = thinking_splitter(state, messages) if grammar is None and tools is None else None
    gen = await start_generation(state, "openai", prompt=prompt_ids,  # rendered with the tools
                                 messages=messages if prompt_ids is None else None,
                                 params=params, session_id=body.user, prompt_param="messages")
    fmt = tool_format(state)
    calls = ToolStream(fmt) if tools is not None and fmt is not None else None
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if not body.stream:
        text, last, deltas = await gen.collect_until_disconnect(request)
        if last.finish_reason == "error":
            raise APIError(500, f"engine error: {last.error or 'unknown'}")
        logprobs = _merge_chat_logprobs([_chat_logprobs(state, d) for d in deltas])
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = last.finish_reason
        if splitter is not None:
            thought, answer = splitter.feed(text, final=True)
            message.update(content=answer, reasoning_content=thought or None)
        if calls is not None:
            content, found = calls.fmt.parse(text)
            if found:
                message.update(content=content or None, tool_calls=_openai_calls(found, calls.fmt))
                finish = "tool_calls"
        return {"id": cid, "object": "chat.completion", "created": created, "model": body.model,
                "choices": [{"index": 0, "message": message,
                             "logprobs": logprobs, "finish_reason": finish}],
                "usage": _usage(last)}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(delta: dict[str, Any], finish: str | None, logprobs: Any = None) -> dict[str, Any]:
        out = {"id": cid, "object": "chat.completion.chunk", "created": created,
               "model": body.model, "choices": [{"index": 0, "delta": delta,
                                                 "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            out["usage"] = None
        return out

    async def events() -> AsyncIterator[str]:
        yield _sse(chunk({"role": "assistant", "content": ""}, None))
        last: StreamDelta | None = None
        async for d in gen.deltas():
            last = d
            if d.finish_reason == "error":
                yield _sse(error_body("/v1", 500, f"engine error: {d.error or 'unknown'}"))
                break
            if calls is not None:  # a call's block is held back and sent whole at the end
                shown = calls.feed(d.text)
                delta: dict[str, Any] = {"content": shown} if shown else {}
                finish = d.finish_reason if d.finished else None
                if d.finished:
                    rest, found = calls.finish()
                    if rest:
                        delta["content"] = delta.get("content", "") + rest
                    if found:
                        delta["tool_calls"] = [{"index": i, **c}
                                               for i, c in enumerate(_openai_calls(found, calls.fmt))]
                        finish = "tool_calls"
                if delta or d.logprobs or d.finished:
                    yield _sse(chunk(delta, finish, _chat_logprobs(state, d)))
            elif d.text or d.logprobs or d.finished:
                yield _sse(chunk(_delta(splitter, d.text, d.finished),
                                 d.finish_reason if d.finished else None,
                                 _chat_logprobs(state, d)))
        if include_usage and last is not None:
            yield _sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                        "model": body.model, "choices": [], "usage": _usage(last)})
        yield "data: [DONE]\n\n"

    return GenerationResponse(events(), gen, "text/event-stream")


@router.post("/embeddings", summary="Embeddings of one input or a batch")
async def create_embeddings(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
    state = await bind_model(request, body.model)
    vectors, tokens = await embeddings.embed(state, embeddings.as_inputs(body.input),
                                             dimensions=body.dimensions)
    encode = embeddings.base64_floats if body.encoding_format == "base64" else list
    return {"object": "list", "model": body.model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _openai_calls(calls: list[ToolCall], fmt: ToolFormat) -> list[dict[str, Any]]:
    """Calls as OpenAI writes them: an id each (of the shape the family's template takes back),
    arguments a JSON string."""
    return [{"id": fmt.call_id(), "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]


def _delta(splitter: ThinkingSplitter | None, text: str, finished: bool) -> dict[str, Any]:
    """A stream chunk's delta: the text as content, or for a thinking model its thinking as
    `reasoning_content` and its answer as `content` (DeepSeek's and vLLM's fields)."""
    if splitter is None:
        return {"content": text} if text else {}
    thought, answer = splitter.feed(text, final=finished)
    out: dict[str, Any] = {}
    if thought:
        out["reasoning_content"] = thought
    if answer:
        out["content"] = answer
    return out


def _completion_logprobs(state: ServerState, delta: StreamDelta,
                         offset: int) -> tuple[dict[str, Any] | None, int]:
    if delta.logprobs is None:
        return None, offset
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                           "text_offset": []}
    for lp in delta.logprobs:
        tok = token_text(state, lp.token_id)
        out["tokens"].append(tok)
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append({token_text(state, t): v for t, v in lp.top})
        out["text_offset"].append(offset)
        offset += len(tok)
    return out, offset


def _merge_completion_logprobs(parts: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    present = [p for p in parts if p is not None]
    if not present:
        return None
    return {k: [v for p in present for v in p[k]] for k in present[0]}


def _completion_prompt(state: ServerState, body: CompletionRequest) -> str | list[int]:
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        vocab = getattr(state.tokenizer, "vocab_size", None)
        if any(t < 0 or (vocab and t >= vocab) for t in prompt):
            raise APIError(400, "prompt has token ids outside the vocabulary", param="prompt")
    if body.suffix is not None:
        if not isinstance(prompt, str):
            raise APIError(400, "suffix needs a text prompt", param="suffix")
        fim = state.tokenizer.fim_ids(prompt, body.suffix) if state.tokenizer else None
        if fim is None:
            raise APIError(400, f"model {state.client.model_name!r} has no fill-in-the-middle "
                           "tokens; suffix is not supported", param="suffix")
        return list(fim)
    if isinstance(prompt, str) and not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    return prompt


@router.post("/completions", summary="Text completion; `suffix` for fill-in-the-middle",
             responses={200: {"model": Completion, "content": _SSE}})
async def completions(body: CompletionRequest, request: Request) -> Any:
    _check_common(body)
    state = await bind_model(request, body.model)
    if body.echo:
        raise APIError(400, "echo is not supported", param="echo")
    if body.best_of not in (None, 1):
        raise APIError(400, "best_of other than 1 is not supported", param="best_of")
    prompt = _completion_prompt(state, body)
    prompt_tokens = count_text_tokens(state, prompt)
    max_tokens = fit_max_tokens(state, prompt_tokens, body.max_tokens, strict=True,
                                prompt_param="prompt")
    params = make_params(
        max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
        stop=stop_list(body.stop), presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, top_k=body.top_k, min_p=body.min_p,
        repetition_penalty=body.repetition_penalty, logprobs=body.logprobs)
    gen = await start_generation(state, "openai", prompt=prompt, params=params,
                                 session_id=body.user)
    cid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if not body.stream:
        return await _complete(state, gen, request, cid, created, body.model)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def events() -> AsyncIterator[str]:
        last: StreamDelta | None = None
        offset = 0
        async for d in gen.deltas():
            last = d
            if d.finish_reason == "error":
                yield _sse(error_body("/v1", 500, f"engine error: {d.error or 'unknown'}"))
                break
            if d.text or d.logprobs or d.finished:
                logprobs, offset = _completion_logprobs(state, d, offset)
                out = {"id": cid, "object": "text_completion", "created": created,
                       "model": body.model,
                       "choices": [{"index": 0, "text": d.text, "logprobs": logprobs,
                                    "finish_reason": d.finish_reason if d.finished else None}]}
                if include_usage:
                    out["usage"] = None
                yield _sse(out)
        if include_usage and last is not None:
            yield _sse({"id": cid, "object": "text_completion", "created": created,
                        "model": body.model, "choices": [], "usage": _usage(last)})
        yield "data: [DONE]\n\n"

    return GenerationResponse(events(), gen, "text/event-stream")


async def _complete(state: ServerState, gen: Generation, request: Request, cid: str,
                    created: int, model: str) -> JSONResponse:
    text, last, deltas = await gen.collect_until_disconnect(request)
    if last.finish_reason == "error":
        raise APIError(500, f"engine error: {last.error or 'unknown'}")
    parts, offset = [], 0
    for d in deltas:
        part, offset = _completion_logprobs(state, d, offset)
        parts.append(part)
    return JSONResponse({"id": cid, "object": "text_completion", "created": created,
                         "model": model,
                         "choices": [{"index": 0, "text": text,
                                      "logprobs": _merge_completion_logprobs(parts),
                                      "finish_reason": last.finish_reason}],
                         "usage": _usage(last)})


__all__ = ["router"]
