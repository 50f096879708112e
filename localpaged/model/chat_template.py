"""Chat templates rendered as transformers renders them, without importing transformers.

A model's chat template is a jinja2 program; transformers runs it in a sandbox with a few
extras (a `tojson` that keeps non-ASCII text, `raise_exception`, `strftime_now`, loop
controls, the `{% generation %}` tag) and the tokenizer's special tokens as variables.
Importing transformers to get that costs a GGUF chat 2-3 s of a core and ~100 MiB after its
load; this module is the same environment on jinja2 alone. The tests compare it with
transformers' `apply_chat_template` on real templates.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Where a message's reasoning may come (the first is the name templates read).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks):
    renders its body as it is."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return str(caller())


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore names (no way to CPython's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template cannot set {name!r} on a namespace (underscore names)")


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, nothing else of the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled in the sandboxed environment chat templates expect (cached:
    a model's template is compiled once)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_Dict(), namespace=_Namespace)
    return env.from_string(source)


def plain_data(value: Any) -> Any:
    """`value` rebuilt from JSON types only (str, int, float, bool, None, dicts, lists,
    tuples): what a template sees, so that no object's methods reach the sandbox. Anything
    else becomes a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _message(message: Any) -> dict[str, Any]:
    """A message as templates get it: its keys without None values, and its reasoning
    under each name templates read."""
    if callable(getattr(message, "model_dump", None)):
        message = message.model_dump()
    if not isinstance(message, Mapping):
        raise TypeError(f"a chat message is a dict, not {type(message).__name__}: {message!r}")
    out = plain_data({k: v for k, v in message.items() if v is not None})
    reasoning = next((out[k] for k in REASONING_FIELDS if out.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def render(source: str, messages: Sequence[Any], *, add_generation_prompt: bool = False,
           special_tokens: Mapping[str, str] | None = None, tools: Sequence[Any] | None = None,
           documents: Sequence[Any] | None = None, **variables: Any) -> str:
    """The text of template `source` for `messages`, as transformers' `apply_chat_template`
    (tokenize=False) renders it: `special_tokens` (bos_token ...) and `variables` (e.g.
    enable_thinking; these win) are the template's variables. `tools` are JSON schemas.
    Raises ValueError for an empty conversation, TypeError for a message or tool of the
    wrong type, jinja2's TemplateError for what the template refuses."""
    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation: give at "
                         "least one message")
    for tool in tools or ():
        if not isinstance(tool, Mapping):
            raise TypeError(f"a tool is a JSON schema (a dict), not {type(tool).__name__}")
    for doc in documents or ():
        if not isinstance(doc, Mapping):
            raise TypeError("documents are dicts with 'title' and 'text' keys")
    return compile_template(source).render(
        messages=[_message(m) for m in messages],
        tools=plain_data(list(tools)) if tools is not None else None,
        documents=plain_data(list(documents)) if documents is not None else None,
        add_generation_prompt=add_generation_prompt,
        **plain_data({**(special_tokens or {}), **variables}),
    )
