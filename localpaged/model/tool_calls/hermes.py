"""The Hermes form Qwen2.5 and Qwen3 write: `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`, one block a call, anywhere after the answer's text."""

from __future__ import annotations

import json
import re

from localpaged.model.tool_calls.base import ToolCall, ToolFormat, call_of

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


class Hermes(ToolFormat):
    name = "hermes"
    markers = (OPEN,)

    @classmethod
    def detect(cls, template: str) -> bool:
        return OPEN in template

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls: list[ToolCall] = []

        def take(m: re.Match[str]) -> str:
            try:
                call = call_of(json.loads(m.group(1)))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return m.group(0)
            calls.append(call)
            return ""

        rest = _BLOCK.sub(take, text)
        return rest.strip(), calls

    def bounds(self) -> tuple[str, str]:
        return OPEN + "\n", "\n" + CLOSE
