"""A thinking model through both APIs (official `openai` and `ollama` clients, real server): its
thinking apart from its answer as OpenAI's `reasoning_content` (message and stream deltas) and
Ollama's `thinking`, `think: false` through the template's own switch, past thinking handed to
the template, and `think` refused for a model that does not think.

The model is the tiny random chat model with an R1-style template (the generation prompt opens
the block), so a random answer is all thinking until it writes `</think>`: what the server
returns must be the raw greedy text split by `split_thinking`, whichever way it is asked."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest

from localpaged.model.thinking import split_thinking
from tests.server.conftest import make_client

THINKING_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' + m.content.split('</think>')[-1] + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '</think>\\n\\n' }}{% endif %}"
    "{% endif %}")
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
NEW = 12


@pytest.fixture(scope="module")
def thinking_model(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-thinking")
    for f in tiny_chat_model.iterdir():
        shutil.copy(f, path / f.name)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def thinking_server(thinking_model: Path) -> Iterator[tuple[str, Any]]:
    from localpaged.server.app import serve_in_background

    client = make_client(thinking_model)
    handle = serve_in_background(client, "127.0.0.1", 0)
    yield handle.url, client
    handle.stop()
    asyncio.run(client.close())


def _raw(client: Any, url: str, model: str, **template_vars: Any) -> str:
    """The greedy text of the same prompt, unsplit (a completion on the rendered prompt ids)."""
    ids = client.tokenizer.apply_chat_template(MESSAGES, **template_vars)
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": ids,
                                                   "max_tokens": NEW, "temperature": 0})
    return r.json()["choices"][0]["text"]


def test_openai_reasoning_content_whole_and_streamed(thinking_server: tuple[str, Any]) -> None:
    url, client = thinking_server
    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    want = split_thinking(_raw(client, url, client.model_name), opened=True)
    assert want[0]  # the random answer has thinking to show
    kw: dict[str, Any] = dict(model=client.model_name, messages=MESSAGES, max_tokens=NEW,
                              temperature=0)
    message = oai.chat.completions.create(**kw).choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == want
    thought, answer = [], []
    for chunk in oai.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            thought.append((delta.model_extra or {}).get("reasoning_content") or "")
            answer.append(delta.content or "")
    assert ("".join(thought), "".join(answer)) == want


def test_past_thinking_goes_to_the_template(thinking_server: tuple[str, Any]) -> None:
    """A second turn carrying the first answer's reasoning_content: the template's rule (it
    drops past thinking) decides the prompt, counted in usage."""
    url, client = thinking_server
    history = [*MESSAGES, {"role": "assistant", "content": "Scattering.",
                           "reasoning_content": "Rayleigh, short waves."},
               {"role": "user", "content": "And sunsets?"}]
    r = httpx.post(url + "/v1/chat/completions", json={
        "model": client.model_name, "messages": history, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in history]
    assert r.json()["usage"]["prompt_tokens"] == len(client.tokenizer.apply_chat_template(plain))
    assert "Rayleigh" not in client.tokenizer.render_chat(
        [{**m} for m in history])  # Qwen3's and R1's templates leave it out of past turns


def test_ollama_think_true_false_and_streamed(thinking_server: tuple[str, Any]) -> None:
    url, client = thinking_server
    oll = ollama.Client(host=url)
    options = {"temperature": 0, "num_predict": NEW}
    want = split_thinking(_raw(client, url, client.model_name), opened=True)
    r = oll.chat(model=client.model_name, messages=MESSAGES, options=options, think=True)
    assert (r.message.thinking, r.message.content) == want
    parts = list(oll.chat(model=client.model_name, messages=MESSAGES, options=options,
                          think=True, stream=True))
    assert ("".join(p.message.thinking or "" for p in parts),
            "".join(p.message.content or "" for p in parts)) == want
    g = oll.generate(model=client.model_name, prompt=MESSAGES[0]["content"], options=options)
    assert (g.thinking, g.response) == want  # `think` unset: a thinking model shows it
    # think: false renders the template with its switch off: the block is closed, all answer
    off = _raw(client, url, client.model_name, enable_thinking=False)
    r = oll.chat(model=client.model_name, messages=MESSAGES, options=options, think=False)
    assert r.message.thinking is None and r.message.content == off.lstrip("\n")


def test_think_is_refused_for_a_model_that_does_not_think(base_url: str,
                                                          model_name: str) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        ollama.Client(host=base_url).chat(model=model_name, messages=MESSAGES, think=True)
    assert err.value.status_code == 400 and "does not support thinking" in str(err.value)
    r = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0
                      ).chat.completions.create(model=model_name, messages=MESSAGES,
                                                max_tokens=4, temperature=0)
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})


def test_the_remote_client_gets_the_block_back(thinking_server: tuple[str, Any]) -> None:
    """`localpaged chat --remote` on a thinking model: the reasoning deltas come back as the
    block the model wrote, so the chat app splits and folds it as it does locally."""
    from localpaged.engine.remote import RemoteClient
    from localpaged.engine.request import SamplingParams

    url, client = thinking_server
    want = split_thinking(_raw(client, url, client.model_name), opened=True)

    async def run() -> str:
        remote = RemoteClient(url)
        try:
            params = SamplingParams(max_tokens=NEW, temperature=0)
            return "".join([d.text async for d in remote.chat(MESSAGES, params)])
        finally:
            await remote.close()

    text = asyncio.run(run())
    assert text.startswith("<think>\n") and split_thinking(text) == want


def test_structured_output_of_a_thinking_model_is_the_answer(
        thinking_server: tuple[str, Any]) -> None:
    """Under a schema the answer is its JSON from the first token (even where the template
    opened a thinking block): all of it is content, none reasoning."""
    url, client = thinking_server
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = httpx.post(url + "/v1/chat/completions", json={
        "model": client.model_name, "messages": MESSAGES, "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    message = r.json()["choices"][0]["message"]
    assert json.loads(message["content"])["ok"] in (True, False)
    assert not message.get("reasoning_content")
