"""Tool-call formats per family: known from the real chat templates (Llama 3.2's and Mistral
7B Instruct v0.3's, as their tokenizer configs hold them), answers parsed streamed and not
(the text before a call shown as it comes, the call kept whole), forced calls' bounds, and
Mistral's 9-character call ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localpaged.model.tool_calls import (
    Hermes,
    Llama3,
    Mistral,
    ToolCall,
    ToolStream,
    format_of,
    mistral_id,
)

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"
LLAMA = (TEMPLATES / "llama-3.2-instruct.jinja").read_text()
MISTRAL = (TEMPLATES / "mistral-7b-instruct-v0.3.jinja").read_text()
HERMES = "{% if tools %}<tools>{{ tools | tojson }}</tools> <tool_call>{% endif %}"
CALL = ToolCall("get_weather", {"city": "Paris", "days": 2})


def test_the_format_is_known_from_the_template() -> None:
    assert isinstance(format_of(LLAMA), Llama3)
    assert isinstance(format_of(MISTRAL), Mistral)
    assert isinstance(format_of(HERMES), Hermes)
    assert format_of("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert format_of(None) is None


ANSWERS = {
    "hermes": ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "days": 2}}\n</tool_call>', "Let me look."),
    "llama3": ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', ""),
    "mistral": ('Let me look.[TOOL_CALLS] [{"name": "get_weather", "arguments": '
                '{"city": "Paris", "days": 2}}]', "Let me look."),
}
FORMATS = {"hermes": Hermes(HERMES), "llama3": Llama3(LLAMA), "mistral": Mistral(MISTRAL)}


@pytest.mark.parametrize("family", sorted(ANSWERS))
def test_a_call_is_read_back_whole_and_streamed(family: str) -> None:
    fmt = FORMATS[family]
    answer, before = ANSWERS[family]
    assert fmt.parse(answer) == (before, [CALL])
    for size in (1, 3, 7):  # in pieces of any size, the text before the call shows first
        stream = ToolStream(fmt)
        shown = "".join(stream.feed(answer[i:i + size]) for i in range(0, len(answer), size))
        rest, calls = stream.finish()
        assert calls == [CALL] and (shown + rest).strip() == before
        assert "get_weather" not in shown


@pytest.mark.parametrize("family", sorted(ANSWERS))
def test_plain_answers_stay_text(family: str) -> None:
    fmt = FORMATS[family]
    for text in ("It is sunny in Paris.", '{"not": "a call"}', "[1, 2] are numbers",
                 "<tool_call>{broken</tool_call>"):
        assert fmt.parse(text) == (text, [])
        stream = ToolStream(fmt)
        shown = "".join(stream.feed(c) for c in text)
        rest, calls = stream.finish()
        assert calls == [] and shown + rest == text


def test_llama_variants() -> None:
    fmt = FORMATS["llama3"]
    # the python tag (where it is decoded), several calls apart by ';', arguments as "arguments"
    text = ('<|python_tag|>{"name": "a", "parameters": {}}; '
            '{"name": "b", "arguments": {"x": 1}}')
    assert fmt.parse(text) == ("", [ToolCall("a", {}), ToolCall("b", {"x": 1})])
    assert fmt.parse('{"name": "a", "parameters": {}} and then some')[1] == []


def test_mistral_without_its_special_token_and_with_several_calls() -> None:
    fmt = FORMATS["mistral"]
    # a tokenizer with [TOOL_CALLS] as a special token decodes the answer without it
    text = '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]'
    assert fmt.parse(text) == ("", [ToolCall("a", {}), ToolCall("b", {"x": 1})])


def test_forced_call_bounds_and_schema() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    prefix, schema, suffix = FORMATS["mistral"].forced(tools, "get_weather")
    assert (prefix, suffix) == ("[TOOL_CALLS] [", "]")  # v0.3's template writes the space
    assert schema["required"] == ["name", "arguments"]
    assert Mistral("... [TOOL_CALLS][ ...").bounds()[0] == "[TOOL_CALLS]["
    prefix, schema, suffix = FORMATS["llama3"].forced(tools, "get_weather")
    assert (prefix, suffix) == ("", "") and schema["required"] == ["name", "parameters"]
    prefix, schema, suffix = FORMATS["hermes"].forced(tools, None)
    assert prefix.startswith("<tool_call>") and suffix.endswith("</tool_call>")
    # a forced call's output (here written by hand) parses back
    for family, fmt in FORMATS.items():
        p, s, q = fmt.forced(tools, "get_weather")
        key = s["required"][1]
        out = p + json.dumps({"name": "get_weather", key: {"city": "Rome"}}) + q
        assert fmt.parse(out) == ("", [ToolCall("get_weather", {"city": "Rome"})]), family


def test_mistral_ids() -> None:
    for _ in range(20):
        cid = FORMATS["mistral"].call_id()
        assert len(cid) == 9 and cid.isalnum()
    assert mistral_id("abcDEF123") == "abcDEF123"
    assert mistral_id("call_1") == mistral_id("call_1") != mistral_id("call_2")
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "call_1", "function": {"name": "a", "arguments": {}}},
            {"type": "function", "function": {"name": "b", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "1"},
        {"role": "tool", "content": "2"},  # Ollama's: no id, paired by order
    ]
    out = FORMATS["mistral"].template_messages(messages)
    ids = [c["id"] for c in out[1]["tool_calls"]]
    assert [m["tool_call_id"] for m in out[2:]] == ids
    assert all(len(i) == 9 and i.isalnum() for i in ids)
    assert messages[1]["tool_calls"][0]["id"] == "call_1"  # the request's own are untouched
