"""RemoteClient against a real HTTP server speaking OpenAI's streaming protocol."""

from __future__ import annotations

import asyncio
import socket

import pytest

from localpaged.engine.client import EngineClient
from localpaged.engine.remote import RemoteClient
from localpaged.engine.request import SamplingParams


@pytest.fixture
def stub(openai_stub):
    return openai_stub


async def collect(stream):
    return [d async for d in stream]


async def test_chat_streams_and_reports_usage(stub) -> None:
    client = RemoteClient(stub.url.removesuffix("/v1"), api_key="k")  # /v1 is added
    assert isinstance(client, EngineClient)
    params = SamplingParams(max_tokens=8, temperature=0, seed=3, stop=["\n\n"])
    deltas = await collect(client.chat([{"role": "user", "content": "hi"}], params,
                                       request_id="r1"))
    assert "".join(d.text for d in deltas) == "You said: hi"
    last = deltas[-1]
    assert last.finished and last.finish_reason == "stop" and last.request_id == "r1"
    assert (last.num_prompt_tokens, last.num_cached_tokens, last.num_output_tokens) == (7, 3, 1)
    assert client.model_name == "echo"  # the server's first model
    sent = stub.requests[-1]
    assert sent["stream"] and sent["max_tokens"] == 8 and sent["seed"] == 3
    assert sent["stop"] == ["\n\n"] and sent["temperature"] == 0
    stats = client.stats()
    assert stats.device.startswith("remote 127.0.0.1") and stats.prefix_cache_hits == 3
    await client.close()


async def test_completions_with_prompt(stub) -> None:
    client = RemoteClient(stub.url, model="echo")
    deltas = await collect(client.generate("abc", SamplingParams(max_tokens=4)))
    assert "".join(d.text for d in deltas) == "You said: abc"
    assert stub.requests[-1]["prompt"] == "abc"
    with pytest.raises(ValueError):
        client.generate("", SamplingParams())
    await client.close()


async def test_http_error_ends_the_stream_with_its_message(stub) -> None:
    client = RemoteClient(stub.url, model="error")
    deltas = await collect(client.chat([{"role": "user", "content": "x"}], SamplingParams()))
    assert len(deltas) == 1 and deltas[0].finish_reason == "error"
    assert "HTTP 500" in deltas[0].error and "the model crashed" in deltas[0].error
    await client.close()


async def test_server_down_is_an_error_not_an_exception() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = RemoteClient(f"http://127.0.0.1:{port}", model="m")
    deltas = await collect(client.chat([{"role": "user", "content": "x"}], SamplingParams()))
    assert deltas[-1].finished and deltas[-1].finish_reason == "error"
    assert "ConnectError" in deltas[-1].error
    await client.close()


async def test_abort_ends_with_abort(stub) -> None:
    client = RemoteClient(stub.url, model="slow")
    stream = client.chat([{"role": "user", "content": "x"}], SamplingParams(), request_id="r")
    got = []

    async def consume() -> None:
        async for d in stream:
            got.append(d)

    task = asyncio.create_task(consume())
    while len(got) < 3:
        await asyncio.sleep(0.01)
    assert client.stats().num_running == 1
    await client.abort("r")
    await asyncio.wait_for(task, 5)
    assert got[-1].finished and got[-1].finish_reason == "abort"
    assert client.stats().num_running == 0
    await client.close()
