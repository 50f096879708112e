"""Mistral (7B Instruct v0.3, Nemo, Small): `[TOOL_CALLS]` then a JSON list of calls
`[{"name": ..., "arguments": {...}}]`. Its templates take only call ids of 9 letters and
digits; ids of other shapes (OpenAI's `call_...`, or none from Ollama) are mapped to such ids
on the way in, the same id for a call and its result."""

from __future__ import annotations

import hashlib
import secrets
import string
from typing import Any

from localpaged.model.tool_calls.base import (
    Messages,
    ToolCall,
    ToolFormat,
    call_of,
    json_values,
)

MARK = "[TOOL_CALLS]"
_ALNUM = string.ascii_letters + string.digits


def mistral_id(given: str | None = None) -> str:
    """A 9-character alphanumeric id: `given` where it is one, else derived from it (or new)."""
    if given is not None and len(given) == 9 and given.isascii() and given.isalnum():
        return given
    if given is None:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    digest = hashlib.sha256(given.encode()).digest()
    return "".join(_ALNUM[b % len(_ALNUM)] for b in digest[:9])


class Mistral(ToolFormat):
    name = "mistral"
    markers = (MARK,)
    # where the tokenizer has [TOOL_CALLS] as a special token, the decoded answer lacks it and
    # starts with the list itself
    leading = ("[",)

    @classmethod
    def detect(cls, template: str) -> bool:
        return MARK in template

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        at = text.find(MARK)
        before, after = (text[:at], text[at + len(MARK):]) if at >= 0 else ("", text)
        found = json_values(after)
        if found is None:
            return text.strip(), []
        values = [x for v in found[0] for x in (v if isinstance(v, list) else [v])]
        calls = [call_of(v) for v in values]
        if not calls or not all(calls):
            return text.strip(), []
        return (before + found[1]).strip(), [c for c in calls if c is not None]

    def bounds(self) -> tuple[str, str]:
        # v0.3's template writes "[TOOL_CALLS] [", Nemo's "[TOOL_CALLS]["
        return (MARK + " [" if MARK + " [" in self.template else MARK + "["), "]"

    def call_id(self) -> str:
        return mistral_id()

    def template_messages(self, messages: Messages) -> Messages:
        out: Messages = []
        pending: list[str] = []  # ids of calls whose results have not come yet, in order
        for m in messages:
            if m.get("tool_calls"):
                calls: list[dict[str, Any]] = []
                for c in m["tool_calls"]:
                    cid = mistral_id(c.get("id"))
                    pending.append(cid)
                    calls.append({**c, "id": cid})
                m = {**m, "tool_calls": calls}
            elif m.get("role") == "tool":
                given = m.get("tool_call_id")
                cid = mistral_id(given) if given else (pending[0] if pending else mistral_id())
                if cid in pending:
                    pending.remove(cid)
                m = {**m, "tool_call_id": cid}
            out.append(m)
        return out
