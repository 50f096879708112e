"""Tool calls through both APIs (official `openai` and `ollama` clients, real server): the tiny
random chat model with a Hermes-style template (Qwen2.5's and Qwen3's form of calls). A call
forced by `tool_choice` (named, or `required`) comes back valid for its function's schema,
streamed and not; a tool result goes back through the template; tools on a model whose
template takes none, an unknown name or a malformed tool are 400s in each dialect."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import ollama
import openai
import pytest

from tests.server.conftest import make_client

TOOL_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\nYou may call functions:\\n<tools>\\n' }}"
    "{%- for t in tools %}{{ t | tojson }}{{ '\\n' }}{%- endfor %}"
    "{{ '</tools>\\nCall one as <tool_call>\\n{\"name\": ..., \"arguments\": ...}\\n</tool_call>"
    "<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{{ '<|im_start|>assistant\\n' }}"
    "{%- for c in m.tool_calls %}{{ '<tool_call>\\n' }}"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "{{ '\\n</tool_call>' }}{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tools_server(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[str, Any]]:
    from localpaged.server.app import serve_in_background

    path = tmp_path_factory.mktemp("tiny-tools")
    for f in tiny_chat_model.iterdir():
        shutil.copy(f, path / f.name)
    (path / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    client = make_client(path)
    handle = serve_in_background(client, "127.0.0.1", 0)
    yield handle.url, client
    handle.stop()
    asyncio.run(client.close())


def _schema(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"]["parameters"]


@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_forced_call_is_valid_streamed_and_not(tools_server: tuple[str, Any],
                                                 choice: str) -> None:
    url, client = tools_server
    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    tool_choice: Any = ({"type": "function", "function": {"name": "get_weather"}}
                        if choice == "named" else "required")
    kw: dict[str, Any] = dict(model=client.model_name, messages=MESSAGES, tools=[WEATHER, CLOCK],
                              tool_choice=tool_choice, max_tokens=120, temperature=0)
    r = oai.chat.completions.create(**kw)
    choice0 = r.choices[0]
    assert choice0.finish_reason == "tool_calls" and len(choice0.message.tool_calls) == 1
    call = choice0.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    tool = WEATHER if call.function.name == "get_weather" else CLOCK
    assert choice == "required" or tool is WEATHER
    jsonschema.validate(json.loads(call.function.arguments), _schema(tool))
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(streamed) == 1 and streamed[0].function.name == call.function.name
    assert json.loads(streamed[0].function.arguments) == json.loads(call.function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_tool_result_goes_back_through_the_template(tools_server: tuple[str, Any]) -> None:
    url, client = tools_server
    args = {"city": "Paris", "unit": "celsius", "days": 1}
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(args)}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    r = oai.chat.completions.create(model=client.model_name, messages=history, tools=[WEATHER],
                                    tool_choice="none", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    r = oai.chat.completions.create(model=client.model_name, messages=history, tools=[WEATHER],
                                    max_tokens=4, temperature=0)
    tok = client.tokenizer
    rendered = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "content": "18 C and sunny", "tool_call_id": "call_1"}]
    assert r.usage.prompt_tokens == len(tok.apply_chat_template(rendered, tools=[WEATHER]))
    text = tok.render_chat(rendered, tools=[WEATHER])
    assert "18 C and sunny" in text and '"city": "Paris"' in text


def test_ollama_tools_and_history(tools_server: tuple[str, Any]) -> None:
    url, client = tools_server
    oll = ollama.Client(host=url)
    r = oll.chat(model=client.model_name, messages=MESSAGES, tools=[WEATHER],
                 options={"temperature": 0, "num_predict": 8})
    assert r.done and (r.message.tool_calls is None or r.message.tool_calls[0].function.name)
    history = [*MESSAGES,
               {"role": "assistant", "content": "", "tool_calls": [
                   {"function": {"name": "get_weather",
                                 "arguments": {"city": "Paris", "unit": "celsius", "days": 1}}}]},
               {"role": "tool", "content": "18 C and sunny"}]
    parts = list(oll.chat(model=client.model_name, messages=history, tools=[WEATHER],
                          options={"temperature": 0, "num_predict": 8}, stream=True))
    assert parts[-1].done


def test_tools_refused_where_they_cannot_be(tools_server: tuple[str, Any], base_url: str,
                                            model_name: str) -> None:
    # a model whose template takes no tools (the session's SmolLM2-templated one)
    r = httpx.post(base_url + "/v1/chat/completions", json={
        "model": model_name, "messages": MESSAGES, "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "does not support tools" in r.json()["error"]["message"]
    with pytest.raises(ollama.ResponseError) as err:
        ollama.Client(host=base_url).chat(model=model_name, messages=MESSAGES, tools=[WEATHER])
    assert err.value.status_code == 400
    url, client = tools_server
    for patch, param in (
            ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
            ({"tool_choice": "sometimes"}, "tool_choice"),
            ({"tools": [{"type": "function"}]}, "tools.0"),
            ({"tool_choice": "required",
              "response_format": {"type": "json_object"}}, "tool_choice")):
        body = {"model": client.model_name, "messages": MESSAGES, "tools": [WEATHER], **patch}
        r = httpx.post(url + "/v1/chat/completions", json=body)
        assert r.status_code == 400, (patch, r.text)
        assert r.json()["error"]["param"] == param
