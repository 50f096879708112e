"""Tool calls in a model's own format, read back from its answer.

The tools go into the prompt through the model's chat template (its `tools` argument); the
answer calls them the way the family was trained to, one format a module:

| format  | families                      | a call                                            |
| ------- | ----------------------------- | ------------------------------------------------- |
| hermes  | Qwen2.5, Qwen3                | `<tool_call>{"name", "arguments"}</tool_call>`     |
| mistral | Mistral v0.3, Nemo, Small     | `[TOOL_CALLS][{"name", "arguments"}, ...]`         |
| llama3  | Llama 3.1, 3.2, 3.3           | the whole answer `{"name", "parameters"}`          |

The format is known by markers in the chat template's text (`format_of`). A call forced by
the request (`tool_choice`) is written through a grammar of exactly that family's form
(`ToolFormat.forced`).
"""

from __future__ import annotations

from localpaged.model.tool_calls.base import ToolCall, ToolFormat, ToolStream, call_schema
from localpaged.model.tool_calls.hermes import Hermes
from localpaged.model.tool_calls.llama3 import Llama3
from localpaged.model.tool_calls.mistral import Mistral, mistral_id

FORMATS: tuple[type[ToolFormat], ...] = (Hermes, Mistral, Llama3)  # checked in this order


def format_of(template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template writes, or None where it takes no tools."""
    if not template or "tools" not in template:
        return None
    for cls in FORMATS:
        if cls.detect(template):
            return cls(template)
    return None


def template_calls_tools(template: str | None) -> bool:
    """Whether a chat template takes tools in a format read back here."""
    return format_of(template) is not None


__all__ = ["FORMATS", "Hermes", "Llama3", "Mistral", "ToolCall", "ToolFormat", "ToolStream",
           "call_schema", "format_of", "mistral_id", "template_calls_tools"]
