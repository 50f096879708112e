"""Helpers both APIs share: model name checks, message flattening, context-length checks,
sampling parameters and token strings."""

from __future__ import annotations

import json
import re
from typing import Any

from localpaged.engine.client import Message
from localpaged.engine.grammar import GrammarSpec
from localpaged.engine.request import SamplingParams
from localpaged.model.thinking import ThinkingSplitter, template_thinks, thinking_of
from localpaged.model.tool_calls import ToolFormat, format_of
from localpaged.server.errors import APIError
from localpaged.server.streams import ServerState

# A model name as users type it: catalog names (`smollm2:135m`), `org/repo` and file-ish names.
# Anything else (path separators at the edges, `..`, control characters) is refused before it
# reaches the store.
MODEL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+@/-]{0,199}")

SEED_MOD = 2**63
TEMPERATURE_EPS = 1e-5  # below this, sampling is greedy (as vLLM does)


def valid_model_name(name: str) -> bool:
    """Whether `name` is safe to hand to the model store."""
    return (MODEL_NAME_RE.fullmatch(name) is not None and ".." not in name
            and "//" not in name and not name.endswith("/"))


def flatten_content(content: Any, param: str) -> str:
    """Message content as one string: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise APIError(400, f"unsupported content part type {part.type!r}: only text is "
                           "supported", param=param)
        texts.append(part.text)
    return "".join(texts)


def engine_messages(messages: list[Any], param: str = "messages") -> list[Message]:
    """Request messages as the engine's `{"role", "content"}` dicts (developer -> system)."""
    out: list[Message] = []
    for i, m in enumerate(messages):
        if getattr(m, "images", None):
            raise APIError(400, "images are not supported", param=f"{param}.{i}.images")
        role = "system" if m.role == "developer" else m.role
        message: Message = {"role": role, "content": flatten_content(m.content, f"{param}.{i}.content")}
        # a past answer's thinking (OpenAI's reasoning_content, Ollama's thinking): for the
        # chat template, whose own rule says whether the prompt shows it
        thinking = getattr(m, "reasoning_content", None) or getattr(m, "thinking", None)
        if thinking and role == "assistant":
            message["reasoning_content"] = thinking
        if getattr(m, "tool_calls", None) and role == "assistant":
            message["tool_calls"] = [_template_call(c, f"{param}.{i}.tool_calls") for c in m.tool_calls]
        if getattr(m, "tool_call_id", None):
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def _template_call(call: Any, param: str) -> dict[str, Any]:
    """A request's tool call (OpenAI's: arguments a JSON string; Ollama's: an object) as chat
    templates take it: arguments an object."""
    f = call.get("function") if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise APIError(400, "a tool call needs function.name", param=param)
    args = f.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError as exc:
            raise APIError(400, f"tool call arguments are not JSON: {exc}", param=param) from exc
    out = {"type": "function", "function": {"name": f["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def tool_format(state: ServerState) -> ToolFormat | None:
    """The tool-call format the loaded model's chat template writes (None: it takes no tools)."""
    return format_of(getattr(state.tokenizer, "chat_template", None))


def tool_messages(state: ServerState, messages: list[Message]) -> list[Message]:
    """`messages` as the model's template takes past calls and results (Mistral's call ids)."""
    fmt = tool_format(state)
    return fmt.template_messages(messages) if fmt is not None else messages


def tool_setup(state: ServerState, tools: list[Any] | None, choice: Any
               ) -> tuple[list[dict[str, Any]] | None, GrammarSpec | None]:
    """(the tools for the chat template, the grammar forcing a call) of a request: None, None
    without tools or with `tool_choice: none`; a grammar for `required` or a named function.
    A 400 for tools on a model whose template takes none, malformed tools, or an unknown name."""
    if not tools or choice == "none":
        return None, None
    fmt = tool_format(state)
    if fmt is None:
        raise APIError(400, f"{state.client.model_name!r} does not support tools (its chat "
                       "template writes no tool calls)", param="tools")
    names = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise APIError(400, "each tool needs type 'function' and function.name",
                           param=f"tools.{i}")
        if "parameters" in f and not isinstance(f["parameters"], dict):
            raise APIError(400, "function.parameters must be a JSON schema object",
                           param=f"tools.{i}")
        names.append(f["name"])
    name: str | None = None
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if name not in names:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the tools "
                           f"({', '.join(names)})", param="tool_choice")
    elif choice not in (None, "auto", "required"):
        raise APIError(400, f"tool_choice {choice!r} is not one of none, auto, required or a "
                       "named function", param="tool_choice")
    if name is None and choice != "required":
        return list(tools), None
    prefix, schema, suffix = fmt.forced(list(tools), name)
    grammar = GrammarSpec.json_schema(schema, prefix, suffix)
    return list(tools), checked_grammar(state, grammar, "tool_choice")


def checked_grammar(state: ServerState, spec: GrammarSpec | None, param: str) -> GrammarSpec | None:
    """`spec` once the engine has compiled it (a 400 naming `param` if the schema is not
    usable, or where the engine is remote)."""
    if spec is None:
        return None
    engine = getattr(state.client, "engine", None)
    if engine is None or not hasattr(engine, "grammar_backend"):
        raise APIError(400, "structured output needs the model served here (not a remote "
                       "engine)", param=param)
    try:
        engine.grammar_backend().compile(spec)
    except ValueError as exc:
        raise APIError(400, str(exc), param=param) from exc
    return spec


def openai_grammar(state: ServerState, response_format: dict[str, Any] | None
                   ) -> GrammarSpec | None:
    """OpenAI's `response_format` as a grammar: `text` none, `json_object` any JSON object,
    `json_schema` its `json_schema.schema` (strict or not, the output follows it)."""
    kind = (response_format or {}).get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return checked_grammar(state, GrammarSpec.json_object(), "response_format")
    if kind == "json_schema":
        schema = ((response_format or {}).get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise APIError(400, "response_format.json_schema.schema must be a JSON schema "
                           "object", param="response_format")
        return checked_grammar(state, GrammarSpec.json_schema(schema), "response_format")
    raise APIError(400, f"response_format type {kind!r} is not supported (text, json_object, "
                   "json_schema)", param="response_format")


def ollama_grammar(state: ServerState, fmt: str | dict[str, Any] | None) -> GrammarSpec | None:
    """Ollama's `format`: "json" (a JSON object) or a JSON schema; empty is none."""
    if fmt in (None, "", {}):
        return None
    if fmt == "json":
        return checked_grammar(state, GrammarSpec.json_object(), "format")
    if isinstance(fmt, dict):
        return checked_grammar(state, GrammarSpec.json_schema(fmt), "format")
    raise APIError(400, f"format {fmt!r} is not supported: give \"json\" or a JSON schema",
                   param="format")


def thinks(state: ServerState) -> bool:
    """Whether the loaded model is a thinking one (its chat template knows `<think>`)."""
    return template_thinks(getattr(state.tokenizer, "chat_template", None))


def thinking_splitter(state: ServerState, messages: list[Message],
                      **template_vars: Any) -> ThinkingSplitter | None:
    """A splitter of the answer to `messages` into thinking and answer when the model thinks
    (None otherwise); it starts inside the block where the template opens it."""
    model_thinks, opened = thinking_of(state.tokenizer, messages, **template_vars)
    return ThinkingSplitter(opened) if model_thinks else None


def count_chat_tokens(state: ServerState, messages: list[Message]) -> int | None:
    """Prompt tokens of `messages` through the chat template, or None without a tokenizer."""
    tok = state.tokenizer
    if tok is None:
        return None
    try:
        return len(tok.apply_chat_template(messages))
    except Exception as exc:  # a template that rejects the conversation (e.g. role order)
        raise APIError(400, f"the model's chat template rejected the messages: {exc}",
                       param="messages") from exc


def count_text_tokens(state: ServerState, prompt: str | list[int]) -> int | None:
    """Prompt tokens of a raw prompt, or None without a tokenizer."""
    if isinstance(prompt, list):
        return len(prompt)
    tok = state.tokenizer
    if tok is None:
        return None
    try:  # count as the engine encodes: with the tokenizer's special tokens (BOS)
        return len(tok.encode(prompt, add_special_tokens=True))
    except TypeError:
        return len(tok.encode(prompt))


def fit_max_tokens(state: ServerState, prompt_tokens: int | None, max_tokens: int | None, *,
                   strict: bool, param: str = "max_tokens",
                   prompt_param: str = "messages") -> int | None:
    """The answer's token budget within the context. With `strict` (OpenAI) a request that does
    not fit is refused, naming both counts; otherwise (Ollama) the budget is clamped."""
    if max_tokens is not None and max_tokens < 1:
        if strict:
            raise APIError(400, f"{param} must be at least 1, got {max_tokens}", param=param)
        max_tokens = None
    ctx = state.context_length()
    if not ctx or prompt_tokens is None:
        return max_tokens
    if prompt_tokens >= ctx:
        raise APIError(400, f"This model's maximum context length is {ctx} tokens, but the "
                       f"prompt has {prompt_tokens} tokens. Shorten the prompt.",
                       param=prompt_param, code="context_length_exceeded")
    room = ctx - prompt_tokens
    if max_tokens is None:
        return room
    if max_tokens > room:
        if strict:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, "
                           f"you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} "
                           f"in the prompt, {max_tokens} for the completion). Reduce the prompt "
                           f"or {param}.", param=param, code="context_length_exceeded")
        return room
    return max_tokens


def stop_list(stop: str | list[str] | None, param: str = "stop") -> list[str]:
    """`stop` as a list of non-empty strings (empty strings are dropped)."""
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else list(stop)
    return [s for s in items if s]


def make_params(**kwargs: Any) -> SamplingParams:
    """SamplingParams from request values (None means default), refusing bad values with a 400
    that names the field."""
    values = {k: v for k, v in kwargs.items() if v is not None}
    if "temperature" in values and 0 < values["temperature"] < TEMPERATURE_EPS:
        values["temperature"] = 0.0
    if "seed" in values:
        values["seed"] = int(values["seed"]) % SEED_MOD
    try:
        return SamplingParams(**values)
    except ValueError as exc:
        field = str(exc).split("=", 1)[0] if "=" in str(exc) else None
        raise APIError(400, str(exc), param=field) from exc


def token_text(state: ServerState, token_id: int) -> str:
    """The text of one token (for logprobs)."""
    tok = state.tokenizer
    if tok is None:
        return f"token_id:{token_id}"
    try:
        return tok.decode([token_id], skip_special_tokens=False)
    except TypeError:
        return tok.decode([token_id])
    except Exception:
        return f"token_id:{token_id}"
