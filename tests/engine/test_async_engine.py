"""AsyncEngine / LocalClient: concurrent streams, cancellation that frees blocks, isolation."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from localpaged import LLM, SamplingParams
from localpaged.engine.async_engine import LocalClient
from localpaged.engine.client import EngineClient

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


async def collect(stream) -> tuple[list[int], str | None]:
    ids, reason = [], None
    async for d in stream:
        ids += d.token_ids
        reason = d.finish_reason
    return ids, reason


async def wait_until(cond, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
def client(tiny_llama: Path):
    c = LocalClient.from_model(str(tiny_llama), dtype="float32", max_num_batched_tokens=64)
    yield c
    c.async_engine.close()


async def test_concurrent_streams_equal_sequential_outputs(client: LocalClient, tiny_llama: Path) -> None:
    assert isinstance(client, EngineClient)
    prompts = [list(range(3 + i, 3 + i + 5 * (i % 4) + 1)) for i in range(16)]
    results = await asyncio.gather(*(collect(client.generate(p, GREEDY, session_id=f"s{i % 3}"))
                                     for i, p in enumerate(prompts)))
    llm = LLM(str(tiny_llama), dtype="float32")
    for p, (ids, reason) in zip(prompts, results):
        assert reason == "length"
        assert ids == llm.generate({"prompt_token_ids": p}, GREEDY)[0].outputs[0].token_ids


async def test_requests_sent_together_start_in_one_step(client: LocalClient,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Four requests sent at once to an idle engine (a client's batch) are all read in its
    first step: the engine waits for its inbox to settle before it starts, so none runs alone
    while the others' prompts wait for chunks beside its decodes."""
    engine = client.engine
    steps: list[list[int]] = []
    execute = engine.runner.execute

    def watched(out, kv):
        steps.append([s.num_new_tokens for s in out.scheduled])
        return execute(out, kv)

    monkeypatch.setattr(engine.runner, "execute", watched)
    prompts = [[7 + i, 8, 9, 10, 11, 12, 13, 14 + i] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    streams = []
    for p in prompts:  # a fraction of a millisecond apart, the engine thread free to start
        streams.append(client.generate(p, params))
        time.sleep(0.0002)
    results = await asyncio.gather(*(collect(st) for st in streams))
    assert [len(ids) for ids, _ in results] == [3] * 4
    assert steps[0] == [8] * 4  # every prompt whole in the first step
    assert all(s == [1] * 4 for s in steps[1:])  # then their decodes together


async def test_leaving_a_stream_aborts_and_frees_blocks(client: LocalClient) -> None:
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    stream = client.generate(list(range(3, 60)), long)
    other = asyncio.create_task(collect(client.generate([7, 8, 9], GREEDY)))
    got = 0
    async for d in stream:
        got += len(d.token_ids)
        if got >= 3:
            break
    await stream.aclose()
    await wait_until(lambda: client.stats().num_running == 0 and client.stats().kv_blocks_used == 0)
    ids, reason = await other
    assert reason == "length" and len(ids) == 16


async def test_cancelled_task_aborts(client: LocalClient) -> None:
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def consume() -> None:
        async for _ in client.generate(list(range(3, 40)), long):
            pass

    task = asyncio.create_task(consume())
    await wait_until(lambda: client.stats().num_running == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: client.stats().num_running == 0 and client.stats().kv_blocks_used == 0)


async def test_bad_request_fails_alone(client: LocalClient) -> None:
    good = asyncio.create_task(collect(client.generate([4, 5], GREEDY)))
    with pytest.raises(ValueError, match="too long"):
        client.generate(list(range(3, 3 + client.engine.max_model_len + 5)), GREEDY)
    with pytest.raises(ValueError, match="empty"):
        client.generate([], GREEDY)
    ids, reason = await good
    assert reason == "length" and len(ids) == 16


def test_the_engine_is_loaded_on_its_own_thread(tiny_llama: Path) -> None:
    """from_model builds the engine on the engine thread (one OpenMP team on the CPU)."""
    import threading

    from localpaged.engine.engine import LLMEngine

    built_on: list[str] = []
    original = LLMEngine.from_args

    def spy(args):
        built_on.append(threading.current_thread().name)
        return original(args)

    LLMEngine.from_args = spy
    try:
        c = LocalClient.from_model(str(tiny_llama), dtype="float32")
    finally:
        LLMEngine.from_args = original
    try:
        assert built_on == ["localpaged-engine"]
        assert c.engine.stats().num_running == 0
    finally:
        c.async_engine.close()


def test_a_model_that_fails_to_load_raises_from_the_constructor(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(Exception, match=r"broken\.gguf"):
        LocalClient.from_model(str(bad))
    with pytest.raises(ValueError, match="dtype"):  # argument errors come before any thread
        LocalClient.from_model(str(bad), dtype="int3")
