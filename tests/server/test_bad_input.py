"""Bad requests get API-style 4xx bodies; the server and the other streams carry on."""

from __future__ import annotations

import re
import threading
from typing import Any

import httpx
import openai
import pytest

USER = [{"role": "user", "content": "hi"}]


def _post(base_url: str, path: str, body: Any) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(base_url + path, content=body,
                          headers={"Content-Type": "application/json"})
    return httpx.post(base_url + path, json=body)


def _openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def _ollama_error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert list(body) == ["error"] and isinstance(body["error"], str)
    return body["error"]


@pytest.mark.parametrize("body", [b"{not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe"])
def test_malformed_json(base_url: str, body: bytes) -> None:
    _openai_error(_post(base_url, "/v1/chat/completions", body), 400)
    _openai_error(_post(base_url, "/v1/completions", body), 400)
    _ollama_error(_post(base_url, "/api/chat", body), 400)
    _ollama_error(_post(base_url, "/api/generate", body), 400)


@pytest.mark.parametrize(("patch", "param"), [
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"stream": {"a": 1}}, "stream"),
    ({"stop": 3}, "stop"),
    ({"model": 7}, "model"),
])
def test_wrong_types_openai(base_url: str, model_name: str, patch: dict[str, Any],
                            param: str) -> None:
    err = _openai_error(_post(base_url, "/v1/chat/completions",
                              {"model": model_name, "messages": USER, **patch}), 400)
    assert err["param"] == param


@pytest.mark.parametrize("patch", [{"messages": "hi"}, {"options": {"temperature": "hot"}},
                                   {"options": []}, {"stream": "sometimes"},
                                   {"keep_alive": "forever"}, {"keep_alive": [1]}])
def test_wrong_types_ollama(base_url: str, model_name: str, patch: dict[str, Any]) -> None:
    _ollama_error(_post(base_url, "/api/chat", {"model": model_name, "messages": USER, **patch}),
                  400)


def test_unknown_model(base_url: str) -> None:
    err = _openai_error(_post(base_url, "/v1/chat/completions",
                              {"model": "gpt-9", "messages": USER}), 404)
    assert err["code"] == "model_not_found" and "gpt-9" in err["message"]
    _openai_error(_post(base_url, "/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404)
    assert "gpt-9" in _ollama_error(_post(base_url, "/api/generate",
                                          {"model": "gpt-9", "prompt": "x"}), 404)
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0).models.retrieve("gpt-9")


def test_context_overflow_says_both_counts(base_url: str, model_name: str,
                                           engine_client: Any) -> None:
    ctx = engine_client.stats().max_model_len
    long = " ".join(["word"] * (ctx + 50))
    err = _openai_error(_post(base_url, "/v1/chat/completions", {
        "model": model_name, "messages": [{"role": "user", "content": long}]}), 400)
    assert err["code"] == "context_length_exceeded"
    numbers = [int(n) for n in re.findall(r"\d+", err["message"])]
    assert ctx in numbers and any(n > ctx for n in numbers)
    # Prompt fits, prompt + max_tokens does not.
    err = _openai_error(_post(base_url, "/v1/completions", {
        "model": model_name, "prompt": "short prompt", "max_tokens": ctx}), 400)
    assert err["param"] == "max_tokens" and str(ctx) in err["message"]
    msg = _ollama_error(_post(base_url, "/api/generate", {
        "model": model_name, "prompt": long, "raw": True}), 400)
    assert str(ctx) in msg and any(int(n) > ctx for n in re.findall(r"\d+", msg))


@pytest.mark.parametrize(("patch", "param"), [
    ({"n": 2}, "n"),
    ({"temperature": 3.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_logprobs": 30, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"presence_penalty": 9}, "presence_penalty"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content"),
])
def test_unsupported_values_openai(base_url: str, model_name: str, patch: dict[str, Any],
                                   param: str) -> None:
    err = _openai_error(_post(base_url, "/v1/chat/completions",
                              {"model": model_name, "messages": USER, **patch}), 400)
    assert err["param"] == param


def test_unsupported_values_completions(base_url: str, model_name: str) -> None:
    for patch, param in (({"echo": True}, "echo"), ({"best_of": 3}, "best_of"),
                         ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": ""}, "prompt"),
                         ({"prompt": [10**9]}, "prompt"), ({"logprobs": 9}, "logprobs")):
        err = _openai_error(_post(base_url, "/v1/completions",
                                  {"model": model_name, "prompt": "x", **patch}), 400)
        assert err["param"] == param


def test_unsupported_values_ollama(base_url: str, model_name: str) -> None:
    for body in ({"format": "yaml"}, {"format": {"type": "nonsense"}},
                 {"options": {"top_p": 0}}, {"images": ["aGk="]}):
        _ollama_error(_post(base_url, "/api/generate",
                            {"model": model_name, "prompt": "x", **body}), 400)


def test_other_streams_carry_on(base_url: str, model_name: str) -> None:
    """A long stream runs while bad requests are refused around it; it finishes whole."""
    result: dict[str, Any] = {}

    def stream() -> None:
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
        chunks = list(client.chat.completions.create(
            model=model_name, messages=USER, max_tokens=60, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        result["usage"] = chunks[-1].usage
        result["text"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    t = threading.Thread(target=stream)
    t.start()
    for _ in range(5):
        _post(base_url, "/v1/chat/completions", b"{oops")
        _post(base_url, "/v1/chat/completions", {"model": model_name, "messages": USER, "n": 5})
        _post(base_url, "/api/chat", {"model": "nope", "messages": USER})
    t.join(60)
    assert result["usage"].completion_tokens >= 1 and result["text"]
    alone = openai.OpenAI(base_url=base_url + "/v1", api_key="x").chat.completions.create(
        model=model_name, messages=USER, max_tokens=60, temperature=0)
    assert alone.choices[0].message.content == result["text"]
