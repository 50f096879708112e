"""Hypothesis fuzzing of request bodies: whatever arrives, the answer is never a 5xx."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

json_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20))
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                max_size=4),
    max_leaves=12)
small_ints = st.integers(-3, 40)
interesting = json_values | small_ints | st.floats(-3, 3) | st.sampled_from(
    ["", "json", "-1", "5m", "user", "assistant", "system", "text"])

USER = [{"role": "user", "content": "hi"}]


def _bases(model: str) -> dict[str, dict[str, Any]]:
    return {
        "/v1/chat/completions": {"model": model, "messages": USER, "max_tokens": 3,
                                 "temperature": 0.5, "top_p": 0.9, "stop": ["\n"], "seed": 1,
                                 "logprobs": True, "top_logprobs": 2, "stream": True,
                                 "stream_options": {"include_usage": True}, "n": 1,
                                 "presence_penalty": 0.1, "frequency_penalty": 0.1},
        "/v1/completions": {"model": model, "prompt": "def f(", "suffix": "return 1",
                            "max_tokens": 3, "logprobs": 1, "stream": True, "echo": False,
                            "temperature": 0.3, "top_k": 5, "min_p": 0.1},
        "/api/chat": {"model": model, "messages": USER, "stream": True, "keep_alive": "5m",
                      "format": "", "options": {"num_predict": 3, "temperature": 0.5,
                                                "top_k": 10, "top_p": 0.9, "min_p": 0.0,
                                                "seed": 3, "stop": ["x"], "num_ctx": 256}},
        "/api/generate": {"model": model, "prompt": "hello", "raw": False, "suffix": "",
                          "system": "s", "stream": True, "keep_alive": -1,
                          "options": {"num_predict": 3, "repeat_penalty": 1.1}},
    }


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    body = json.loads(json.dumps(base))
    keys = sorted(body)
    for key in draw(st.lists(st.sampled_from(keys), max_size=3, unique=True)):
        if draw(st.booleans()):
            body[key] = draw(interesting)
        else:
            del body[key]
    if isinstance(body.get("options"), dict):
        for key in draw(st.lists(st.sampled_from(sorted(body["options"]) or ["x"]), max_size=2)):
            body["options"][key] = draw(interesting)
    for key in draw(st.lists(st.text(max_size=8), max_size=2)):
        body.setdefault(key, draw(json_values))
    return body


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=60) as client:
        yield client


def _status(http: httpx.Client, path: str, body: Any) -> int:
    """Send, check the status and the first lines of a 200 (no error events from the engine),
    then hang up (a fuzzed body may ask for a long answer; leaving early aborts it)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with http.stream("POST", path, content=content,
                     headers={"Content-Type": "application/json"}) as r:
        if r.status_code >= 500:
            r.read()
            raise AssertionError(f"{r.status_code} for {path} {body!r}: {r.text}")
        if r.status_code >= 400:
            r.read()
            err = r.json()["error"]
            assert isinstance(err, dict if path.startswith("/v1") else str), r.text
        else:
            lines = r.iter_lines()
            for _, line in zip(range(6), lines):
                assert '"error"' not in line, f"{path} {body!r}: {line}"
            lines.close()
        return r.status_code


FUZZ = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/api/chat",
                                  "/api/generate"])
def test_mutated_bodies_never_5xx(http: httpx.Client, model_name: str, path: str) -> None:
    base = _bases(model_name)[path]

    @FUZZ
    @given(body=mutated(base))
    def check(body: dict[str, Any]) -> None:
        _status(http, path, body)

    check()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/api/chat",
                                  "/api/generate", "/api/show", "/api/pull"])
def test_arbitrary_json_never_5xx(http: httpx.Client, path: str) -> None:
    @FUZZ
    @given(body=json_values | st.binary(max_size=40))
    def check(body: Any) -> None:
        assert _status(http, path, body) < 500

    check()
