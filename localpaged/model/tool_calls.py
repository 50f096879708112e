"""Tool calls in a model's own format, read back from its answer.

The tools go into the prompt through the model's chat template (its `tools` argument); the
answer calls them the way the family was trained to. Supported: the Hermes form that Qwen2.5
and Qwen3 use, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (one block a call),
known by the template writing `<tool_call>`. A call forced by the request (`tool_choice`) is
written through a grammar of exactly that form (`call_grammar`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from localpaged.model.thinking import held_back

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


@dataclass
class ToolCall:
    """One call: the function's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


def template_calls_tools(template: str | None) -> bool:
    """Whether a chat template takes tools and its model writes Hermes-style calls."""
    return bool(template) and "tools" in template and OPEN in template  # type: ignore[operator]


def parse(text: str) -> tuple[str, list[ToolCall]]:
    """(the answer's text outside its call blocks, the calls). A block that is not a call's
    JSON stays in the text."""
    calls: list[ToolCall] = []

    def take(m: re.Match[str]) -> str:
        try:
            value = json.loads(m.group(1))
        except json.JSONDecodeError:
            return m.group(0)
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return m.group(0)
        args = value.get("arguments", value.get("parameters", {}))
        calls.append(ToolCall(value["name"], args if isinstance(args, dict) else {}))
        return ""

    rest = _BLOCK.sub(take, text)
    return rest.strip(), calls


def call_schema(tools: list[dict[str, Any]], name: str | None = None) -> dict[str, Any]:
    """The JSON schema of one call to `name` (or to any of `tools`): its name and arguments
    (the function's parameters)."""
    options = []
    for t in tools:
        f = t["function"]
        if name is not None and f["name"] != name:
            continue
        params = f.get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {"name": {"const": f["name"]},
                                                          "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    return options[0] if len(options) == 1 else {"anyOf": options}


def call_text_bounds() -> tuple[str, str]:
    """The literal text before and after a call's JSON (the grammar's prefix and suffix)."""
    return OPEN + "\n", "\n" + CLOSE


class ToolStream:
    """A streamed answer that may call tools: `feed` gives the text to show now (what cannot
    be the start of a call block), `finish` the rest and the calls."""

    def __init__(self) -> None:
        self.text = ""
        self.shown = 0
        self.in_call = False

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.in_call:
            return ""
        at = self.text.find(OPEN, self.shown)
        if at >= 0:
            self.in_call = True
            out, self.shown = self.text[self.shown:at], at
            return out
        end = len(self.text) - held_back(self.text, OPEN)
        out, self.shown = self.text[self.shown:end], max(self.shown, end)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The text not shown yet (outside the calls) and the calls of the whole answer."""
        return parse(self.text[self.shown:])
