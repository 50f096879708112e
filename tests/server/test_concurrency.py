"""Many clients at once, clients that leave early, and the queue cap."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest

from localpaged.server.app import serve_in_background


def _prompts(n: int) -> list[list[dict[str, str]]]:
    topics = ["rivers", "owls", "prime numbers", "tea", "volcanoes", "jazz", "maps", "bread"]
    return [[{"role": "user", "content": f"Tell me fact {i} about {topics[i % len(topics)]}."}]
            for i in range(n)]


async def _stream_one(client: openai.AsyncOpenAI, model: str, messages: Any) -> tuple[str, str]:
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=16,
                                                  temperature=0, stream=True)
    text, reason = "", ""
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


def test_32_concurrent_streams_match_sequential_greedy(base_url: str, model_name: str) -> None:
    prompts = _prompts(32)

    async def run() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x",
                                      max_retries=0, timeout=120) as client:
            together = await asyncio.gather(*(_stream_one(client, model_name, p)
                                              for p in prompts))
            alone = [await _stream_one(client, model_name, p) for p in prompts]
        return list(together), alone

    together, alone = asyncio.run(run())
    assert all(reason in ("stop", "length") for _, reason in together)
    assert all(text for text, _ in together)
    assert together == alone


def _wait_idle(engine_client: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        stats = engine_client.stats()
        if (stats.num_running == 0 and stats.num_waiting == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.parametrize("api", ["openai", "ollama"])
def test_disconnect_mid_stream_frees_blocks(base_url: str, model_name: str, engine_client: Any,
                                            api: str) -> None:
    before = _wait_idle(engine_client)
    if api == "openai":
        url, body = "/v1/chat/completions", {
            "model": model_name, "stream": True, "max_tokens": 400, "temperature": 0,
            "messages": [{"role": "user", "content": f"A long story, please ({api})."}]}
    else:
        url, body = "/api/generate", {"model": model_name, "prompt": "A long story, please.",
                                      "raw": True, "options": {"num_predict": 400,
                                                               "temperature": 0}}
    with httpx.Client(base_url=base_url) as http:
        with http.stream("POST", url, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            while got < 3:
                got += bool(next(lines))
            during = engine_client.stats()
            assert during.num_running == 1 and during.kv_blocks_used > before.kv_blocks_used
            lines.close()
        # The connection is closed here, mid-answer.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            metrics = http.get("/metrics").text
            if _metric(metrics, "localpaged_kv_blocks_used") <= before.kv_blocks_used and \
                    _metric(metrics, "localpaged_requests_running") == 0:
                break
            time.sleep(0.02)
    after = engine_client.stats()
    assert after.num_running == 0 and after.kv_blocks_used <= before.kv_blocks_used
    assert after.generation_tokens_total - before.generation_tokens_total < 400
    assert 'finish_reason="abort"' in metrics


def test_disconnect_while_waiting_for_a_whole_answer(base_url: str, model_name: str,
                                                     engine_client: Any) -> None:
    """A non-streaming client that gives up (timeout) aborts its request too."""
    before = _wait_idle(engine_client)
    body = {"model": model_name, "max_tokens": 450, "temperature": 0, "stream": False,
            "messages": [{"role": "user", "content": "Write a very long essay."}]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url + "/v1/chat/completions", json=body, timeout=0.3)
    after = _wait_idle(engine_client)
    assert after.kv_blocks_used <= before.kv_blocks_used
    assert after.generation_tokens_total - before.generation_tokens_total < 450


def test_queue_cap_answers_429(engine_client: Any, model_name: str) -> None:
    handle = serve_in_background(engine_client, max_queued=1)
    try:
        with httpx.Client(base_url=handle.url) as http:
            body = {"model": model_name, "stream": True, "max_tokens": 300,
                    "messages": [{"role": "user", "content": "hold the slot"}]}
            with http.stream("POST", "/v1/chat/completions", json=body) as held:
                assert held.status_code == 200
                held_lines = held.iter_lines()
                next(held_lines)
                r = http.post("/v1/chat/completions", json={**body, "stream": False})
                assert r.status_code == 429
                assert r.json()["error"]["type"] == "rate_limit_error"
                r = http.post("/api/generate", json={"model": model_name, "prompt": "x"})
                assert r.status_code == 429 and "error" in r.json()
            _wait_idle(engine_client)
            r = http.post("/v1/chat/completions", json={**body, "stream": False,
                                                        "max_tokens": 2})
            assert r.status_code == 200
    finally:
        handle.stop()
