"""The Ollama-compatible API, driven by the official `ollama` client against the real server."""

from __future__ import annotations

import json
from typing import Any

import httpx
import ollama
import pytest

MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
GREEDY = {"temperature": 0, "num_predict": 8}


@pytest.fixture(scope="module")
def oll(base_url: str) -> ollama.Client:
    return ollama.Client(host=base_url)


def test_version_is_new_enough_for_copilot(base_url: str) -> None:
    version = httpx.get(base_url + "/api/version").json()["version"]
    assert tuple(int(x) for x in version.split(".")) >= (0, 6, 4)
    assert httpx.get(base_url + "/").text == "Ollama is running"


def test_tags_lists_the_loaded_model(oll: ollama.Client, model_name: str,
                                     base_url: str) -> None:
    models = oll.list().models
    assert models[0].model == model_name
    raw = httpx.get(base_url + "/api/tags").json()["models"][0]
    assert {"name", "model", "modified_at", "size", "digest", "details"} <= set(raw)
    assert {"format", "family", "parameter_size", "quantization_level"} <= set(raw["details"])
    assert raw["details"]["family"] == "llama"


def test_show(oll: ollama.Client, model_name: str, engine_client: Any) -> None:
    r = oll.show(model_name)
    assert "completion" in r.capabilities and "insert" in r.capabilities
    assert r.modelinfo["general.architecture"] == "llama"
    assert r.modelinfo["llama.context_length"] == engine_client.stats().max_model_len
    assert r.template == engine_client.tokenizer.chat_template
    assert r.details.family == "llama"
    with pytest.raises(ollama.ResponseError) as err:
        oll.show("no-such-model:7b")
    assert err.value.status_code == 404


def test_ps(oll: ollama.Client, model_name: str) -> None:
    running = oll.ps().models
    assert [m.model for m in running] == [model_name]
    assert running[0].expires_at is not None


def test_chat_streaming_and_not(oll: ollama.Client, model_name: str) -> None:
    whole = oll.chat(model=model_name, messages=MESSAGES, options=GREEDY)
    assert whole.done and whole.done_reason in ("stop", "length")
    assert whole.message.role == "assistant" and whole.message.content
    for field in ("prompt_eval_count", "eval_count", "total_duration", "load_duration",
                  "prompt_eval_duration", "eval_duration"):
        assert getattr(whole, field) is not None, field
    assert whole.eval_count <= 8 and whole.prompt_eval_count > 0
    parts = list(oll.chat(model=model_name, messages=MESSAGES, options=GREEDY, stream=True))
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count


def test_generate_templated_raw_and_system(oll: ollama.Client, model_name: str) -> None:
    r = oll.generate(model=model_name, prompt="Hello", options=GREEDY)
    assert r.done and r.response
    streamed = list(oll.generate(model=model_name, prompt="Hello", options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == r.response
    raw = oll.generate(model=model_name, prompt="Hello", raw=True, options=GREEDY)
    assert raw.prompt_eval_count < r.prompt_eval_count  # no chat template around it
    short = oll.generate(model=model_name, prompt="Hello", system="Be brief.", options=GREEDY)
    longer = oll.generate(model=model_name, prompt="Hello", options=GREEDY,
                          system="Be brief. Answer in one short sentence, no lists.")
    assert longer.prompt_eval_count > short.prompt_eval_count


def test_generate_with_suffix_is_fim(oll: ollama.Client, model_name: str,
                                     engine_client: Any) -> None:
    prefix, suffix = "def add(a, b):\n    ", "\n    return c\n"
    r = oll.generate(model=model_name, prompt=prefix, suffix=suffix, options=GREEDY)
    assert r.prompt_eval_count == len(engine_client.tokenizer.fim_ids(prefix, suffix))


def test_options_and_keep_alive_forms(oll: ollama.Client, model_name: str) -> None:
    options = {"num_ctx": 2048, "num_predict": 3, "stop": ["\n\n"], "temperature": 0.7,
               "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 7}
    for keep_alive in ("5m", "1h30m", 300, -1, "-1", 0):
        r = oll.chat(model=model_name, messages=MESSAGES, options=options, keep_alive=keep_alive)
        assert r.done and r.eval_count <= 3
    a = oll.generate(model=model_name, prompt="x", options=options)
    b = oll.generate(model=model_name, prompt="x", options=options)
    assert a.response == b.response  # seeded


def test_load_and_unload_replies(base_url: str, model_name: str) -> None:
    r = httpx.post(base_url + "/api/generate", json={"model": model_name}).json()
    assert r["done"] and r["done_reason"] == "load"
    r = httpx.post(base_url + "/api/chat", json={"model": model_name, "messages": [],
                                                 "keep_alive": 0}).json()
    assert r["done"] and r["done_reason"] == "unload"


def test_unknown_fields_are_ignored(base_url: str, model_name: str) -> None:
    body = {"model": model_name, "messages": MESSAGES, "stream": False, "options": {
        **GREEDY, "mirostat": 2, "num_gpu": 99}, "think": False, "truncate": True,
        "whatever": {"nested": [1, 2]}}
    r = httpx.post(base_url + "/api/chat", json=body)
    assert r.status_code == 200 and r.json()["done"]


def test_pull_of_the_loaded_model_streams_progress(base_url: str, model_name: str) -> None:
    with httpx.stream("POST", base_url + "/api/pull", json={"model": model_name}) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[0]["status"] == "pulling manifest" and lines[-1] == {"status": "success"}
    r = httpx.post(base_url + "/api/pull", json={"model": "../../etc/passwd", "stream": False})
    assert r.status_code == 400 and "invalid model name" in r.json()["error"]


def test_client_errors_are_ollama_style(oll: ollama.Client, model_name: str) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        oll.chat(model="no-such-model", messages=MESSAGES)
    assert err.value.status_code == 404 and "not found" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        oll.chat(model=model_name, messages=MESSAGES, options={"temperature": -1})
    assert err.value.status_code == 400 and "temperature" in err.value.error
