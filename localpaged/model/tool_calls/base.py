"""What every family's tool-call format shares: a call, the schema of a forced call, and the
stream that shows the text before a call as it comes and keeps the call whole for the end."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

from localpaged.model.thinking import held_back

Messages = list[dict[str, Any]]


@dataclass
class ToolCall:
    """One call: the function's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


def call_of(value: Any) -> ToolCall | None:
    """A decoded JSON value as a call (`name` and `arguments`, or Llama's `parameters`; the
    arguments an object or a JSON string of one), or None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError:
            return None
    return ToolCall(value["name"], args) if isinstance(args, dict) else None


def json_values(text: str) -> tuple[list[Any], str] | None:
    """The JSON values at the start of `text` (one, or several apart by whitespace or `;`),
    and the text after them; None if `text` does not start with one."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    rest = text.lstrip()
    while rest[:1] in ("{", "["):
        try:
            value, end = decoder.raw_decode(rest)
        except json.JSONDecodeError:
            break
        values.append(value)
        rest = rest[end:].lstrip().lstrip(";").lstrip()
    return (values, rest) if values else None


class ToolFormat:
    """One family's way of writing calls. `markers`: texts that open a call anywhere in the
    answer (the text before them is the answer's own); `leading`: texts that make the whole
    answer a call when it starts with one."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()
    leading: ClassVar[tuple[str, ...]] = ()
    args_key: ClassVar[str] = "arguments"  # the arguments' key in a call's JSON

    def __init__(self, template: str) -> None:
        self.template = template

    @classmethod
    def detect(cls, template: str) -> bool:
        """Whether `template` (a chat template that takes tools) writes this format."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the answer's text outside its calls, the calls). What is not a valid call stays
        in the text."""
        raise NotImplementedError

    def bounds(self) -> tuple[str, str]:
        """The literal text before and after one call's JSON (a forced call's grammar)."""
        raise NotImplementedError

    def forced(self, tools: list[dict[str, Any]], name: str | None = None
               ) -> tuple[str, dict[str, Any], str]:
        """(prefix, JSON schema, suffix) of exactly one call to `name` (or to any of
        `tools`): what a grammar holds a forced call to."""
        prefix, suffix = self.bounds()
        return prefix, call_schema(tools, name, self.args_key), suffix

    def call_id(self) -> str:
        """A new call's id, as OpenAI's API writes them."""
        return f"call_{uuid.uuid4().hex[:24]}"

    def template_messages(self, messages: Messages) -> Messages:
        """`messages` as this family's template wants them (the same for most)."""
        return messages


def call_schema(tools: list[dict[str, Any]], name: str | None = None,
                args_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call to `name` (or to any of `tools`): its name and arguments
    (the function's parameters) under `args_key`."""
    options = []
    for t in tools:
        f = t["function"]
        if name is not None and f["name"] != name:
            continue
        params = f.get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {"name": {"const": f["name"]},
                                                          args_key: params},
                        "required": ["name", args_key], "additionalProperties": False})
    return options[0] if len(options) == 1 else {"anyOf": options}


class ToolStream:
    """A streamed answer that may call tools: `feed` gives the text to show now (what cannot
    be the start of a call), `finish` the rest and the calls."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self.shown = 0
        self.in_call = False

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.in_call:
            return ""
        if self.shown == 0 and self.fmt.leading:  # a call as the whole answer?
            start = self.text.lstrip()
            if any(start.startswith(t) for t in self.fmt.leading):
                self.in_call = True
                return ""
            if not start or any(t.startswith(start) for t in self.fmt.leading):
                return ""  # not known yet
        found = [at for at in (self.text.find(m, self.shown) for m in self.fmt.markers)
                 if at >= 0]
        if found:
            self.in_call = True
            out, self.shown = self.text[self.shown:min(found)], min(found)
            return out
        hold = max((held_back(self.text, m) for m in self.fmt.markers), default=0)
        end = len(self.text) - hold
        out, self.shown = self.text[self.shown:end], max(self.shown, end)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The text not shown yet (outside the calls) and the calls of the whole answer."""
        return self.fmt.parse(self.text[self.shown:])
