"""Several models at once, through the official clients against the real server on loopback:
requests name any pulled model (two tiny random Llamas in a temporary store, loaded on demand
by the real engine), /api/ps lists them with their expiry, keep_alive 0 unloads, the least
recently used goes past --max-loaded-models and past a memory budget that fits two, a model
larger than the whole budget is a clear 400 before anything is unloaded, one load however
many ask at once, unknown models 404, a corrupt file is a clear error that leaves the others
serving, and three clients chat, autocomplete and embed on three models at once."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest

A, B, C, BROKEN, HUGE = "tiny-a", "tiny-b", "tiny-c", "broken:q4", "huge:q4"
HUGE_BYTES = 4 * 2**30  # a sparse file: its size on disk, not its blocks
MESSAGES = [{"role": "user", "content": "Say something."}]


def _register(name: str, path: Path, fmt: str, gguf_file: str | None = None) -> None:
    from localpaged.store.registry import RegisteredModel, add

    size = path.stat().st_size if path.is_file() else sum(
        f.stat().st_size for f in path.glob("*.safetensors"))
    add(RegisteredModel(name=name, format=fmt, path=str(path), source="import",
                        pulled_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        size_bytes=size, gguf_file=gguf_file, family="llama"))


def _second_model(first: Path, target: Path, seed: int = 1) -> Path:
    """The tiny chat Llama's shape and tokenizer with other random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig.from_pretrained(first)
    LlamaForCausalLM(config).save_pretrained(target, safe_serialization=True)
    for f in first.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, target / f.name)
    return target


@pytest.fixture(scope="module")
def store_home(tmp_path_factory: pytest.TempPathFactory, tiny_chat_model: Path) -> Iterator[Path]:
    """A data dir with tiny-a (the tiny chat model), tiny-b and tiny-c (same shape and
    tokenizer, FIM tokens included, other weights), broken:q4 (a .gguf file whose body is
    noise) and huge:q4 (a 4 GiB sparse .gguf file, larger than a small budget)."""
    home = tmp_path_factory.mktemp("pool-home")
    broken = home / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(range(256)) * 16)
    huge = home / "huge.gguf"
    with huge.open("wb") as f:
        f.write(b"GGUF")
        f.truncate(HUGE_BYTES)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALPAGED_HOME", str(home))
        mp.setenv("HF_HUB_OFFLINE", "1")
        _register(A, tiny_chat_model, "safetensors")
        _register(B, _second_model(tiny_chat_model, home / "tiny-b"), "safetensors")
        _register(C, _second_model(tiny_chat_model, home / "tiny-c", seed=2), "safetensors")
        _register(BROKEN, broken, "gguf", gguf_file=broken.name)
        _register(HUGE, huge, "gguf", gguf_file=huge.name)
        yield home


class CountingLoader:
    """The real loader (LocalClient on the CPU, small KV pool), counting its loads."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, name: str, progress: Callable[[str], None]) -> Any:
        from localpaged.engine.async_engine import LocalClient

        with self.lock:
            self.calls.append(name)
        return LocalClient.from_model(name, device="cpu", dtype="float32", num_kv_blocks=128,
                                      max_num_seqs=8, max_model_len=256)


def _serve(max_loaded: int, memory_budget: int | None = None
           ) -> Iterator[tuple[str, Any, CountingLoader]]:
    from localpaged.engine.model_pool import ModelPool
    from localpaged.server.app import pulled_size, serve_in_background

    loader = CountingLoader()
    pool = ModelPool(loader, max_loaded=max_loaded, memory_budget=memory_budget,
                     estimate=pulled_size)  # as `localpaged serve` builds it
    handle = serve_in_background(pool=pool)
    yield handle.url, pool, loader
    handle.stop()
    asyncio.run(pool.close())


@pytest.fixture(scope="module")
def three(store_home: Path) -> Iterator[tuple[str, Any, CountingLoader]]:
    """A server keeping up to three models loaded."""
    yield from _serve(3)


@pytest.fixture(scope="module")
def sizes(store_home: Path) -> tuple[int, int]:
    """A tiny model's memory as the pool measures it once loaded, and its estimate (its size
    on disk, what the pool counts before loading it)."""
    from localpaged.engine.model_pool import client_memory
    from localpaged.server.app import pulled_size

    client = CountingLoader()(C, lambda _: None)
    try:
        return client_memory(client), pulled_size(C)
    finally:
        asyncio.run(client.close())


@pytest.fixture(scope="module")
def two_fit(sizes: tuple[int, int]) -> Iterator[tuple[str, Any, CountingLoader]]:
    """A server whose memory budget (--memory-budget) fits two tiny models loaded, not a
    third beside them (its count limit, three, is not what binds)."""
    loaded, estimate = sizes
    budget = loaded + estimate + loaded // 2  # two loaded fit; two + a third's estimate don't
    assert 2 * loaded <= budget < 2 * loaded + estimate and loaded + estimate <= budget
    yield from _serve(3, memory_budget=budget)


@pytest.fixture(scope="module")
def one(store_home: Path) -> Iterator[tuple[str, Any, CountingLoader]]:
    """A server keeping one model loaded."""
    yield from _serve(1)


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _answer(client: openai.OpenAI, model: str) -> str:
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8,
                                       temperature=0)
    assert r.model == model
    return r.choices[0].message.content or ""


def _running(url: str) -> list[str]:
    return [m.model for m in ollama.Client(host=url).ps().models]


def _wait(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def _reference(engine_client: Any) -> str:
    """tiny-a's greedy answer from the engine directly (the session's engine on its files)."""
    from localpaged.engine.request import SamplingParams

    async def run() -> str:
        params = SamplingParams(max_tokens=8, temperature=0)
        return "".join([d.text async for d in engine_client.chat(MESSAGES, params)])

    return asyncio.run(run())


def test_two_models_answer_each_as_itself_and_are_listed(three, engine_client: Any) -> None:
    url, _, loader = three
    oai = _openai(url)
    a, b = _answer(oai, A), _answer(oai, B)
    assert a == _reference(engine_client)  # tiny-a's weights answered
    assert b != a and _answer(oai, B) == b and _answer(oai, A) == a
    chat = ollama.Client(host=url).chat(model=f"{A}:latest", messages=MESSAGES,
                                        options={"temperature": 0, "num_predict": 8})
    assert chat.message.content == a
    assert sorted(loader.calls) == [A, B]  # each loaded once
    ps = ollama.Client(host=url).ps().models
    assert [m.model for m in ps] == [A, B]  # most recently used first
    now = datetime.now(timezone.utc)
    for m in ps:  # the default keep-alive: five minutes from now
        assert 200 < (m.expires_at - now).total_seconds() <= 301 and m.size > 0
    tags = [m.model for m in ollama.Client(host=url).list().models]
    assert tags[:2] == [A, B] and BROKEN in tags
    assert {A, B, BROKEN} <= {m.id for m in oai.models.list().data}
    assert oai.models.retrieve(BROKEN).id == BROKEN


def test_keep_alive_zero_unloads_after_the_answer(three) -> None:
    url, _, loader = three
    oll = ollama.Client(host=url)
    r = oll.chat(model=B, messages=MESSAGES, options={"num_predict": 4}, keep_alive=0)
    assert r.done and r.message.content
    _wait(lambda: B not in _running(url))
    # keep_alive -1: stays; then an empty request with keep_alive 0 unloads it (Ollama's way)
    oll.generate(model=A, prompt="Hi", options={"num_predict": 2}, keep_alive=-1)
    assert next(m for m in oll.ps().models if m.model == A).expires_at.year == 2318
    assert oll.generate(model=A, keep_alive=0).done_reason == "unload"
    _wait(lambda: A not in _running(url))
    r = oll.generate(model=A, prompt="Hi", options={"num_predict": 2}, keep_alive="1m")
    assert r.done and loader.calls.count(A) == 2  # loaded again on demand
    expires = next(m for m in oll.ps().models if m.model == A).expires_at
    assert 30 < (expires - datetime.now(timezone.utc)).total_seconds() <= 61


def test_unknown_model_is_a_404_naming_it(three) -> None:
    url, _, loader = three
    with pytest.raises(openai.NotFoundError) as err:
        _answer(_openai(url), "no-such-model:7b")
    assert "model 'no-such-model:7b' not found" in str(err.value)
    assert "localpaged pull no-such-model:7b" in str(err.value)
    with pytest.raises(ollama.ResponseError) as oerr:
        ollama.Client(host=url).chat(model="nope", messages=MESSAGES)
    assert oerr.value.status_code == 404 and "not found" in oerr.value.error
    assert "nope" not in loader.calls and "no-such-model:7b" not in loader.calls


def test_a_corrupt_file_is_a_clear_error_and_the_others_keep_serving(three) -> None:
    url, _, _ = three
    oai = _openai(url)
    before = _answer(oai, A)
    loaded = _running(url)
    with pytest.raises(openai.InternalServerError) as err:
        _answer(oai, BROKEN)
    text = str(err.value)
    assert f"model '{BROKEN}' failed to load" in text and "corrupt GGUF" in text
    with pytest.raises(ollama.ResponseError) as oerr:
        ollama.Client(host=url).generate(model=BROKEN, prompt="Hi")
    assert oerr.value.status_code == 500 and "failed to load" in oerr.value.error
    assert _answer(oai, A) == before and set(_running(url)) == set(loaded)


def test_max_loaded_one_unloads_the_least_recently_used(one) -> None:
    url, pool, loader = one
    oai = _openai(url)
    _answer(oai, A)
    first = pool.find(A).client
    assert _running(url) == [A]
    _answer(oai, B)
    assert _running(url) == [B] and loader.calls == [A, B]
    assert first.async_engine._closed  # its engine was stopped, not just forgotten
    _answer(oai, A)
    assert _running(url) == [A] and loader.calls == [A, B, A]


def test_concurrent_first_requests_load_once(one) -> None:
    url, pool, loader = one
    if pool.find(B) is not None:  # make B the unloaded one
        _answer(_openai(url), A)
    assert pool.find(B) is None
    before = loader.calls.count(B)

    async def ask() -> list[str]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        async with client:
            rs = await asyncio.gather(*(client.chat.completions.create(
                model=B, messages=MESSAGES, max_tokens=4, temperature=0) for _ in range(3)))
        return [r.choices[0].message.content or "" for r in rs]

    answers = asyncio.run(ask())
    assert loader.calls.count(B) == before + 1 and len(set(answers)) == 1
    assert _running(url) == [B]
    raw = httpx.get(url + "/api/ps").json()["models"]
    assert [m["name"] for m in raw] == [B] and raw[0]["expires_at"].endswith("Z")


def test_a_budget_that_fits_two_unloads_the_least_recently_used(two_fit) -> None:
    url, pool, loader = two_fit
    oai = _openai(url)
    a, b = _answer(oai, A), _answer(oai, B)
    assert _answer(oai, A) == a  # A used again: B is now the least recently used
    assert _running(url) == [A, B] and loader.calls == [A, B]
    first_b = pool.find(B).client
    c = _answer(oai, C)
    assert _running(url) == [C, A] and loader.calls == [A, B, C]
    assert first_b.async_engine._closed and pool.memory_used() <= pool.memory_budget
    assert c not in (a, b) and _answer(oai, A) == a  # A kept serving, not reloaded
    assert _answer(oai, B) == b and _running(url) == [B, A]  # then C was the least recent
    assert loader.calls == [A, B, C, B]


def test_a_model_larger_than_the_budget_is_a_400_and_nothing_is_unloaded(two_fit) -> None:
    url, pool, loader = two_fit
    oai = _openai(url)
    _answer(oai, A)
    loaded, calls = _running(url), list(loader.calls)
    budget = f"{pool.memory_budget / 2**20:.1f} MiB"
    with pytest.raises(openai.BadRequestError) as err:
        _answer(oai, HUGE)
    body = err.value.body
    assert isinstance(body, dict) and body["code"] == "model_too_large" and body["param"] == "model"
    assert body["message"].startswith(f"model '{HUGE}' needs about 4.0 GiB, more than the "
                                      f"whole memory budget of {budget}")
    assert "raise --memory-budget" in body["message"]
    with pytest.raises(ollama.ResponseError) as oerr:
        ollama.Client(host=url).generate(model=HUGE, prompt="Hi")
    assert oerr.value.status_code == 400 and f"budget of {budget}" in oerr.value.error
    assert loader.calls == calls and _running(url) == loaded  # refused before any load
    assert _answer(oai, A)  # still serving


def test_a_model_that_fits_only_once_models_in_use_finish_waits_for_them(two_fit) -> None:
    url, pool, loader = two_fit
    oai = _openai(url)
    held = {m: asyncio.run(pool.acquire(m)) for m in (A, C)}  # two requests in flight, say
    timeout = pool.room_timeout
    try:
        assert sorted(_running(url)) == [A, C]
        calls = len(loader.calls)
        pool.room_timeout = 0.5
        with pytest.raises(openai.InternalServerError) as err:  # never unloads one in use
            _answer(oai, B)
        assert err.value.status_code == 503
        assert f"beside the models in use ({A}, {C}); waited " in str(err.value)
        assert sorted(_running(url)) == [A, C] and len(loader.calls) == calls
        pool.room_timeout = 30.0
        answer: list[str] = []
        waiting = threading.Thread(target=lambda: answer.append(_answer(oai, B)))
        waiting.start()
        time.sleep(0.3)
        assert waiting.is_alive() and len(loader.calls) == calls  # waits for room
        held.pop(C).release()  # C idle: unloaded to make room, A (in use) kept
        waiting.join(30)
        assert answer and answer[0] and _running(url) == [B, A]
    finally:
        pool.room_timeout = timeout
        for lease in held.values():
            lease.release()


FIM_PROMPT, FIM_SUFFIX = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
EMBED_INPUT = "The quick brown fox"


def _chat_stream(client: openai.OpenAI, model: str) -> str:
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16,
                                            temperature=0, stream=True)
    parts = []
    for chunk in stream:
        assert chunk.model == model
        parts.extend(c.delta.content or "" for c in chunk.choices)
    return "".join(parts)


def _autocomplete(client: openai.OpenAI, model: str) -> str:
    r = client.completions.create(model=model, prompt=FIM_PROMPT, suffix=FIM_SUFFIX,
                                  max_tokens=8, temperature=0)
    assert r.model == model
    return r.choices[0].text


def _embedding(client: openai.OpenAI, model: str) -> list[float]:
    r = client.embeddings.create(model=model, input=EMBED_INPUT)
    assert r.model == model
    return r.data[0].embedding


def test_three_clients_chat_autocomplete_and_embed_on_three_models_at_once(three) -> None:
    url, pool, _ = three
    assert pool.max_loaded >= 3
    jobs: dict[str, tuple[Callable[[openai.OpenAI, str], Any], str]] = {
        "chat": (_chat_stream, A), "fim": (_autocomplete, B), "embed": (_embedding, C)}
    start = threading.Barrier(len(jobs))
    results: dict[str, Any] = {}
    errors: list[BaseException] = []

    def client_thread(kind: str) -> None:
        call, model = jobs[kind]
        client = _openai(url)  # one client (and connection pool) each
        try:
            start.wait(5)
            results[kind] = call(client, model)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=client_thread, args=(k,)) for k in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert set(_running(url)) == {A, B, C}  # all three loaded at once
    # each answered by its own model: the same requests alone answer the same, and another
    # model answers them otherwise
    oai = _openai(url)
    assert results["chat"] and results["chat"] == _chat_stream(oai, A)
    assert results["fim"] and results["fim"] == _autocomplete(oai, B)
    assert results["fim"] != _autocomplete(oai, A)
    alone = _embedding(oai, C)
    assert len(results["embed"]) == len(alone) == 64
    assert max(abs(x - y) for x, y in zip(results["embed"], alone)) < 1e-4
    assert max(abs(x - y) for x, y in zip(_embedding(oai, A), alone)) > 1e-2
