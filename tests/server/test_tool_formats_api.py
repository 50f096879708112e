"""Tool calls in each family's format (Hermes, Llama 3.x, Mistral), through the real server
and the official clients: the tiny random chat model given the Hermes-style test template and
Llama 3.2's and Mistral 7B Instruct v0.3's own chat templates (tests/fixtures/chat_templates).
A forced call comes back valid for its schema in the family's shape, streamed and not
(Mistral's ids 9 letters and digits, as its template takes them back); a call and its result
go back through the family's template; and an agent library (langchain-openai) binds a tool,
forces the call, sends back the result and gets a final answer."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import ollama
import openai
import pytest

from tests.server.conftest import make_client
from tests.server.test_tools_api import CLOCK, MESSAGES, TOOL_TEMPLATE, WEATHER

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"
FAMILIES = {"hermes": None, "llama3": "llama-3.2-instruct.jinja",
            "mistral": "mistral-7b-instruct-v0.3.jinja"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_server(request: pytest.FixtureRequest, tiny_chat_model: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Any]]:
    from localpaged.server.app import serve_in_background

    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    for f in tiny_chat_model.iterdir():
        shutil.copy(f, path / f.name)
    name = FAMILIES[request.param]
    (path / "chat_template.jinja").write_text(
        (TEMPLATES / name).read_text() if name else TOOL_TEMPLATE)
    client = make_client(path)
    handle = serve_in_background(client, "127.0.0.1", 0)
    yield request.param, handle.url, client
    handle.stop()
    asyncio.run(client.close())


def _check_id(family: str, call_id: str) -> None:
    if family == "mistral":
        assert len(call_id) == 9 and call_id.isalnum(), call_id
    else:
        assert call_id.startswith("call_")


def test_a_forced_call_in_the_family_format(family_server: tuple[str, str, Any]) -> None:
    family, url, client = family_server
    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    kw: dict[str, Any] = dict(
        model=client.model_name, messages=MESSAGES, tools=[CLOCK, WEATHER], max_tokens=80,
        temperature=0, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = oai.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls"
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and not r.choices[0].message.content
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    _check_id(family, call.id)
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(streamed) == 1 and streamed[0].function.name == "get_weather"
    assert json.loads(streamed[0].function.arguments) == args
    _check_id(family, streamed[0].id)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    # the call and its result back through the family's template (the client's id as given)
    history = [*MESSAGES, r.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    again = oai.chat.completions.create(model=client.model_name, messages=history,
                                        tools=[WEATHER], max_tokens=4, temperature=0)
    tok = client.tokenizer
    rendered = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": call.id, "function": {"name": "get_weather",
                                                        "arguments": args}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    text = tok.render_chat(rendered, tools=[WEATHER])
    assert again.usage.prompt_tokens == len(tok.apply_chat_template(rendered, tools=[WEATHER]))
    shape = json.dumps(args, ensure_ascii=False)  # as the templates' tojson writes
    if family == "hermes":
        assert '<tool_call>\n{"name": "get_weather", "arguments": ' + shape + "}" in text
        assert "<tool_response>\n18 C and sunny\n</tool_response>" in text
    elif family == "llama3":
        assert '{"name": "get_weather", "parameters": ' + shape + "}<|eot_id|>" in text
        # (the template writes a string result as JSON: a string is iterable)
        assert "<|start_header_id|>ipython<|end_header_id|>\n\n\"18 C and sunny\"<|eot_id|>" in text
    else:
        assert f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {shape}, "id": "{call.id}"}}]' \
            in text
        assert f'[TOOL_RESULTS] {{"content": 18 C and sunny, "call_id": "{call.id}"}}' in text


def test_openai_style_ids_and_ollama_history(family_server: tuple[str, str, Any]) -> None:
    """A history with OpenAI's `call_...` ids, or Ollama's none, goes through Mistral's
    template (which takes 9-character ids only) and Llama's alike."""
    _family, url, client = family_server
    args = {"city": "Paris", "unit": "celsius", "days": 1}
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_abc", "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(args)}}]},
               {"role": "tool", "tool_call_id": "call_abc", "content": "18 C and sunny"}]
    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    r = oai.chat.completions.create(model=client.model_name, messages=history, tools=[WEATHER],
                                    max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    r = oai.chat.completions.create(model=client.model_name, messages=history, max_tokens=4,
                                    temperature=0, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].finish_reason in ("stop", "length")
    oll = ollama.Client(host=url)
    ollama_history = [*MESSAGES,
                      {"role": "assistant", "content": "", "tool_calls": [
                          {"function": {"name": "get_weather", "arguments": args}}]},
                      {"role": "tool", "content": "18 C and sunny"}]
    parts = list(oll.chat(model=client.model_name, messages=ollama_history, tools=[WEATHER],
                          options={"temperature": 0, "num_predict": 4}, stream=True))
    assert parts[-1].done


def test_an_agent_library_round_trip(family_server: tuple[str, str, Any]) -> None:
    """langchain-openai's ChatOpenAI against the server: a tool bound and its call forced by
    name (valid arguments, invoked and streamed), the tool's result sent back with the call's
    id, and a final answer."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    family, url, client = family_server
    llm = ChatOpenAI(model=client.model_name, base_url=url + "/v1", api_key="unused",
                     temperature=0, max_tokens=60, max_retries=0)
    forced = llm.bind_tools([WEATHER], tool_choice="get_weather")
    question = HumanMessage("What is the weather in Paris?")
    call_msg = forced.invoke([question])
    [call] = call_msg.tool_calls
    assert call["name"] == "get_weather" and not call_msg.invalid_tool_calls
    jsonschema.validate(call["args"], WEATHER["function"]["parameters"])
    _check_id(family, call["id"])
    streamed = None
    for chunk in forced.stream([question]):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None and [c["args"] for c in streamed.tool_calls] == [call["args"]]

    result = ToolMessage("18 C and sunny", tool_call_id=call["id"])
    final = llm.bind_tools([WEATHER]).invoke([question, call_msg, result])
    assert isinstance(final, AIMessage) and not final.tool_calls
    assert isinstance(final.content, str) and final.content
    assert final.response_metadata["finish_reason"] in ("stop", "length")
    # the server saw the result through the template: more prompt than the question alone
    assert final.usage_metadata["input_tokens"] > call_msg.usage_metadata["input_tokens"]
