"""Llama 3.1 / 3.2 / 3.3 (Meta's templates): a call is the whole answer, the JSON
`{"name": ..., "parameters": {...}}` (after `<|python_tag|>` where the model writes one;
several calls apart by `;`). Tool results come back in the `ipython` role."""

from __future__ import annotations

from localpaged.model.tool_calls.base import ToolCall, ToolFormat, call_of, json_values

PYTHON_TAG = "<|python_tag|>"


class Llama3(ToolFormat):
    name = "llama3"
    leading = ("{", PYTHON_TAG)
    args_key = "parameters"

    @classmethod
    def detect(cls, template: str) -> bool:
        return PYTHON_TAG in template or ("ipython" in template and '"parameters"' in template)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):]
        found = json_values(body)
        if found is None or found[1]:  # not JSON, or text after it: an answer, not a call
            return text.strip(), []
        calls = [call_of(v) for v in found[0]]
        if not all(calls):
            return text.strip(), []
        return "", [c for c in calls if c is not None]

    def bounds(self) -> tuple[str, str]:
        return "", ""
