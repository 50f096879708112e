"""Embeddings through both APIs (official `openai` and `ollama` clients, real server, real
engine): the vector is transformers' last-token hidden state of the same tokens, normalized
(cosine >= 0.9999), batches of 64 in one request, `dimensions` (shortened and normalized
again), a cached prefix serving a repeat, embeddings beside 8 streaming chats, and bad input
refused with a 400 in each dialect."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest
import torch

TEXTS = ["Paged attention stores the KV cache in blocks.", "hello", "A cat sat on the mat. " * 6]


@pytest.fixture(scope="module")
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_chat_model: Path, engine_client: Any):
    """transformers' base model on the tokens the server embeds: normalized last hidden state."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_chat_model, dtype=torch.float32).eval()
    tok = engine_client.tokenizer

    def vector(text: str) -> torch.Tensor:
        ids = tok.encode(text, add_special_tokens=True)
        with torch.no_grad():
            h = model(torch.tensor([ids])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(h, dim=-1)

    return vector


def _cos(a: list[float] | torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(torch.as_tensor(a, dtype=torch.float32), b.float()))


def test_openai_embeddings_equal_transformers(oai: openai.OpenAI, model_name: str,
                                             reference) -> None:
    r = oai.embeddings.create(model=model_name, input=TEXTS)  # the client asks for base64
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == model_name
    for d, text in zip(r.data, TEXTS, strict=True):
        assert _cos(d.embedding, reference(text)) >= 0.9999
        assert abs(torch.tensor(d.embedding).norm().item() - 1) < 1e-5
    assert r.usage.prompt_tokens == r.usage.total_tokens > len(TEXTS)
    floats = oai.embeddings.create(model=model_name, input=TEXTS[0], encoding_format="float")
    assert _cos(floats.data[0].embedding, reference(TEXTS[0])) >= 0.9999


def test_dimensions_shorten_and_normalize(oai: openai.OpenAI, model_name: str,
                                          reference) -> None:
    r = oai.embeddings.create(model=model_name, input=TEXTS[0], dimensions=16)
    want = torch.nn.functional.normalize(reference(TEXTS[0])[:16], dim=-1)
    assert len(r.data[0].embedding) == 16 and _cos(r.data[0].embedding, want) >= 0.9999


def test_a_batch_of_64_and_a_cached_prefix(oai: openai.OpenAI, model_name: str,
                                          engine_client: Any, reference) -> None:
    texts = [f"Item {i}: " + "the quick brown fox jumps over the lazy dog " * 4 for i in range(64)]
    r = oai.embeddings.create(model=model_name, input=texts)
    assert len(r.data) == 64
    for i in (0, 31, 63):
        assert _cos(r.data[i].embedding, reference(texts[i])) >= 0.9999
    hits = _settled_stats(engine_client).prefix_cache_hits
    again = oai.embeddings.create(model=model_name, input=texts[5])  # its blocks are cached
    assert _settled_stats(engine_client).prefix_cache_hits > hits
    assert _cos(again.data[0].embedding, torch.tensor(r.data[5].embedding)) >= 0.9999


def _settled_stats(client: Any) -> Any:
    """The engine's stats once its thread has refreshed them after the last request (the
    snapshot is taken between steps: a request just answered may still show as waiting)."""
    deadline = time.perf_counter() + 10
    while True:
        st = client.stats()
        if (st.num_waiting == 0 and st.num_running == 0) or time.perf_counter() > deadline:
            return st
        time.sleep(0.01)


def test_ollama_embed_and_embeddings(base_url: str, model_name: str, reference) -> None:
    oll = ollama.Client(host=base_url)
    r = oll.embed(model=model_name, input=TEXTS)
    assert len(r.embeddings) == 3 and r.prompt_eval_count > 3
    for v, text in zip(r.embeddings, TEXTS, strict=True):
        assert _cos(v, reference(text)) >= 0.9999
    one = oll.embed(model=model_name, input=TEXTS[1], dimensions=8)
    assert len(one.embeddings) == 1 and len(one.embeddings[0]) == 8
    legacy = oll.embeddings(model=model_name, prompt=TEXTS[1])
    assert _cos(legacy.embedding, reference(TEXTS[1])) >= 0.9999


async def test_embeddings_beside_streaming_chats(base_url: str, model_name: str) -> None:
    """8 chats streaming while 64 inputs are embedded: every chat streams to its end, the
    embeddings come back, and no chat waits long between its pieces."""
    gaps: list[float] = []

    async def chat(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": model_name, "stream": True, "max_tokens": 24, "temperature": 0,
                "messages": [{"role": "user", "content": f"Tell me about number {i}."}]}
        pieces, last = 0, time.perf_counter()
        async with client.stream("POST", base_url + "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    now = time.perf_counter()
                    gaps.append(now - last)
                    last = now
                    pieces += bool(json.loads(line[6:])["choices"])
        return pieces

    async with httpx.AsyncClient(timeout=120) as client:
        chats = [asyncio.create_task(chat(client, i)) for i in range(8)]
        await asyncio.sleep(0.05)
        r = await client.post(base_url + "/v1/embeddings", json={
            "model": model_name, "input": [f"text {i} " * 20 for i in range(64)],
            "encoding_format": "float"})
        done = await asyncio.gather(*chats)
    assert r.status_code == 200 and len(r.json()["data"]) == 64
    assert all(n >= 2 for n in done)
    assert max(gaps) < 30  # every chat kept streaming (a stall would hang to the timeout)


@pytest.mark.parametrize(("path", "body", "message"), [
    ("/v1/embeddings", {"input": []}, "input must be"),
    ("/v1/embeddings", {"input": "x", "dimensions": 0}, "dimensions=0"),
    ("/v1/embeddings", {"input": "x", "dimensions": 100000}, "more than the model's"),
    ("/v1/embeddings", {"input": [[]]}, "input"),
    ("/api/embed", {"input": "word " * 2000, "truncate": False}, "the context is"),
])
def test_bad_input_is_a_400(base_url: str, model_name: str, path: str, body: dict,
                            message: str) -> None:
    r = httpx.post(base_url + path, json={"model": model_name, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in (err["message"] if isinstance(err, dict) else err)


def test_truncate_keeps_a_long_input(base_url: str, model_name: str) -> None:
    r = httpx.post(base_url + "/api/embed", json={"model": model_name, "input": "word " * 2000})
    assert r.status_code == 200 and len(r.json()["embeddings"]) == 1
