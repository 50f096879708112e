"""The engine room's RemoteClient (what `localpaged chat` uses to attach to a running server)
against this server: the same answers, usage and cached counts, and aborts that free blocks."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import openai

from localpaged.engine.remote import RemoteClient
from localpaged.engine.request import SamplingParams

MESSAGES = [{"role": "user", "content": "Count to ten, please."}]


def test_remote_client_round_trip(base_url: str, model_name: str, engine_client: Any) -> None:
    expected = openai.OpenAI(base_url=base_url + "/v1", api_key="x").chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=12, temperature=0)

    async def run() -> tuple[str, Any, Any]:
        client = RemoteClient(base_url)
        try:
            params = SamplingParams(max_tokens=12, temperature=0)
            deltas = [d async for d in client.chat(MESSAGES, params)]
            again = [d async for d in client.chat(MESSAGES, params)]
            # Leave a long answer early: the server aborts it.
            stream = client.chat(MESSAGES, SamplingParams(max_tokens=400, temperature=0))
            async for _ in stream:
                break
            await stream.aclose()
        finally:
            await client.close()
        return "".join(d.text for d in deltas), deltas[-1], again[-1]

    text, last, again = asyncio.run(run())
    assert text == expected.choices[0].message.content
    assert last.finished and last.num_output_tokens == expected.usage.completion_tokens
    assert again.num_cached_tokens > 0
    deadline = time.monotonic() + 10
    while engine_client.stats().num_running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine_client.stats().num_running == 0
