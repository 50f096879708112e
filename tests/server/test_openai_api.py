"""The OpenAI-compatible API, driven by the official `openai` client against the real server."""

from __future__ import annotations

from typing import Any

import openai
import pytest

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(oai: openai.OpenAI, model_name: str) -> None:
    ids = [m.id for m in oai.models.list().data]
    assert ids == [model_name]
    assert oai.models.retrieve(model_name).id == model_name


def test_chat_non_streaming(oai: openai.OpenAI, model_name: str) -> None:
    r = oai.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=8,
                                    temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 8


def test_chat_streaming_equals_non_streaming(oai: openai.OpenAI, model_name: str) -> None:
    kw: dict[str, Any] = dict(model=model_name, messages=MESSAGES, max_tokens=12, temperature=0)
    whole = oai.chat.completions.create(**kw).choices[0].message.content
    chunks = list(oai.chat.completions.create(**kw, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and not chunks[-1].choices
    assert usage_chunks[0].usage.completion_tokens >= 1


def test_stream_without_include_usage_has_no_usage(oai: openai.OpenAI, model_name: str) -> None:
    chunks = list(oai.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=3,
                                              stream=True))
    assert all(c.usage is None for c in chunks)


def test_second_turn_reports_cached_prompt_tokens(oai: openai.OpenAI, model_name: str) -> None:
    # A long first turn, so that several full KV blocks can be shared.
    first_msgs = [{"role": "system", "content": "Remember this list: " + ", ".join(
        f"item {i}" for i in range(60))}, {"role": "user", "content": "What is item 7?"}]
    r1 = oai.chat.completions.create(model=model_name, messages=first_msgs, max_tokens=6,
                                     temperature=0)
    second = [*first_msgs, {"role": "assistant", "content": r1.choices[0].message.content},
              {"role": "user", "content": "And item 8?"}]
    r2 = oai.chat.completions.create(model=model_name, messages=second, max_tokens=6,
                                     temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 * ((r1.usage.prompt_tokens // 16) - 1)
    assert cached < r2.usage.prompt_tokens
    assert r1.usage.prompt_tokens_details.cached_tokens < r1.usage.prompt_tokens


def test_max_completion_tokens_and_seeded_sampling(oai: openai.OpenAI, model_name: str) -> None:
    kw: dict[str, Any] = dict(model=model_name, messages=MESSAGES, max_completion_tokens=5,
                              temperature=1.0, top_p=0.9, seed=1234, presence_penalty=0.5,
                              frequency_penalty=0.5)
    a = oai.chat.completions.create(**kw)
    b = oai.chat.completions.create(**kw)
    assert a.usage.completion_tokens <= 5
    assert a.choices[0].message.content == b.choices[0].message.content


def test_chat_logprobs(oai: openai.OpenAI, model_name: str) -> None:
    r = oai.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=4,
                                    temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert item.logprob == pytest.approx(max(t.logprob for t in item.top_logprobs), abs=1e-4)
    streamed = list(oai.chat.completions.create(model=model_name, messages=MESSAGES,
                                                max_tokens=4, temperature=0, logprobs=True,
                                                top_logprobs=1, stream=True))
    n = sum(len(c.choices[0].logprobs.content) for c in streamed
            if c.choices and c.choices[0].logprobs)
    assert n == len(content)


def test_stop_string_is_not_in_the_text(oai: openai.OpenAI, model_name: str) -> None:
    base = oai.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=20,
                                       temperature=0).choices[0].message.content
    assert base
    stop = base[len(base) // 2:][:3] if len(base) >= 6 else base[-1]
    r = oai.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=20,
                                    temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].message.content
    assert base.startswith(r.choices[0].message.content)


def test_completions_streaming_and_not(oai: openai.OpenAI, model_name: str) -> None:
    r = oai.completions.create(model=model_name, prompt="def fibonacci(n):", max_tokens=10,
                               temperature=0, logprobs=2)
    assert r.object == "text_completion" and r.usage.completion_tokens >= 1
    assert len(r.choices[0].logprobs.tokens) == r.usage.completion_tokens
    assert "".join(r.choices[0].logprobs.tokens) == r.choices[0].text
    chunks = list(oai.completions.create(model=model_name, prompt="def fibonacci(n):",
                                         max_tokens=10, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_completions_with_token_id_prompt(oai: openai.OpenAI, model_name: str,
                                          engine_client: Any) -> None:
    ids = engine_client.tokenizer.encode("hello world")
    a = oai.completions.create(model=model_name, prompt=ids, max_tokens=5, temperature=0)
    assert a.usage.prompt_tokens == len(ids)


def test_fill_in_the_middle(oai: openai.OpenAI, model_name: str, engine_client: Any) -> None:
    prefix, suffix = "def add(a, b):\n    ", "\n    return c\n"
    fim = engine_client.tokenizer.fim_ids(prefix, suffix)
    assert fim is not None
    r = oai.completions.create(model=model_name, prompt=prefix, suffix=suffix, max_tokens=6,
                               temperature=0)
    assert r.usage.prompt_tokens == len(fim)
    # Same answer as the raw FIM token ids sent as a prompt.
    raw = oai.completions.create(model=model_name, prompt=list(fim), max_tokens=6, temperature=0)
    assert r.choices[0].text == raw.choices[0].text
    streamed = list(oai.completions.create(model=model_name, prompt=prefix, suffix=suffix,
                                           max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_openapi_document_covers_the_openai_part(base_url: str) -> None:
    import httpx

    doc = httpx.get(base_url + "/openapi.json").json()
    assert {"/v1/models", "/v1/chat/completions", "/v1/completions"} <= set(doc["paths"])
    assert not any(p.startswith("/api/") for p in doc["paths"])
    schema = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert {"model", "messages", "stream", "logprobs", "max_completion_tokens"} <= set(
        schema["properties"])
    post = doc["paths"]["/v1/chat/completions"]["post"]
    assert {"200", "400", "404", "429"} <= set(post["responses"]) and "422" not in post["responses"]


def test_answers_match_the_documented_shapes(oai: openai.OpenAI, model_name: str,
                                             base_url: str) -> None:
    import httpx

    from localpaged.server.schemas import ChatCompletion, Completion, ErrorResponse, ModelList

    ModelList.model_validate(httpx.get(base_url + "/v1/models").json())
    body = {"model": model_name, "messages": MESSAGES, "max_tokens": 3, "logprobs": True,
            "top_logprobs": 2}
    ChatCompletion.model_validate(httpx.post(base_url + "/v1/chat/completions", json=body).json())
    Completion.model_validate(httpx.post(base_url + "/v1/completions", json={
        "model": model_name, "prompt": "x", "max_tokens": 3, "logprobs": 1}).json())
    ErrorResponse.model_validate(httpx.post(base_url + "/v1/completions", json={}).json())


def test_unknown_fields_are_ignored(oai: openai.OpenAI, model_name: str) -> None:
    r = oai.chat.completions.create(
        model=model_name, messages=[{"role": "developer", "content": "Be terse."},
                                    {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        max_tokens=2, metadata={"plugin": "test"}, parallel_tool_calls=False,
        extra_body={"plugin_specific": {"a": [1, 2]}, "ignore_eos": True})
    assert r.usage.completion_tokens >= 1
