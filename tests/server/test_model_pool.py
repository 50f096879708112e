"""Several models at once, through the official clients against the real server on loopback:
requests name any pulled model (two tiny random Llamas in a temporary store, loaded on demand
by the real engine), /api/ps lists them with their expiry, keep_alive 0 unloads, the least
recently used goes past --max-loaded-models, one load however many ask at once, unknown
models 404, and a corrupt file is a clear error that leaves the others serving."""

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

A, B, BROKEN = "tiny-a", "tiny-b", "broken:q4"
MESSAGES = [{"role": "user", "content": "Say something."}]


def _register(name: str, path: Path, fmt: str, gguf_file: str | None = None) -> None:
    from localpaged.store.registry import RegisteredModel, add

    size = path.stat().st_size if path.is_file() else sum(
        f.stat().st_size for f in path.glob("*.safetensors"))
    add(RegisteredModel(name=name, format=fmt, path=str(path), source="import",
                        pulled_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        size_bytes=size, gguf_file=gguf_file, family="llama"))


def _second_model(first: Path, target: Path) -> Path:
    """The tiny chat Llama's shape and tokenizer with other random weights (seed 1)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig.from_pretrained(first)
    LlamaForCausalLM(config).save_pretrained(target, safe_serialization=True)
    for f in first.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, target / f.name)
    return target


@pytest.fixture(scope="module")
def store_home(tmp_path_factory: pytest.TempPathFactory, tiny_chat_model: Path) -> Iterator[Path]:
    """A data dir with tiny-a (the tiny chat model), tiny-b (same shape, other weights) and
    broken:q4 (a .gguf file whose body is noise)."""
    home = tmp_path_factory.mktemp("pool-home")
    broken = home / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(range(256)) * 16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALPAGED_HOME", str(home))
        mp.setenv("HF_HUB_OFFLINE", "1")
        _register(A, tiny_chat_model, "safetensors")
        _register(B, _second_model(tiny_chat_model, home / "tiny-b"), "safetensors")
        _register(BROKEN, broken, "gguf", gguf_file=broken.name)
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


def _serve(max_loaded: int) -> Iterator[tuple[str, Any, CountingLoader]]:
    from localpaged.engine.model_pool import ModelPool
    from localpaged.server.app import serve_in_background

    loader = CountingLoader()
    pool = ModelPool(loader, max_loaded=max_loaded)
    handle = serve_in_background(pool=pool)
    yield handle.url, pool, loader
    handle.stop()
    asyncio.run(pool.close())


@pytest.fixture(scope="module")
def three(store_home: Path) -> Iterator[tuple[str, Any, CountingLoader]]:
    """A server keeping up to three models loaded."""
    yield from _serve(3)


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
