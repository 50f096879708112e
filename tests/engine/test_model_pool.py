"""ModelPool's bookkeeping with a fake loader: one load per model however many ask at once,
least recently used idle models unloaded past the count or the memory budget, never one in
use, keep-alive expiry, failed loads."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from localpaged.engine.model_pool import (
    ModelBusyError,
    ModelLoadError,
    ModelPool,
    ModelTooLargeError,
    UnknownModelError,
)

GIB = 2**30


class FakeClient:
    """Stands in for a LocalClient: a name, the memory it reports, and whether it is closed."""

    def __init__(self, name: str, size: int = GIB) -> None:
        self.model_name = name
        self.engine = SimpleNamespace(weights_bytes=size, kv_bytes=0)
        self.closed = False

    async def close(self) -> None:
        self.closed = True


class FakeLoader:
    """Counts loads; `gate` holds them; names starting with "bad" fail."""

    def __init__(self, sizes: dict[str, int] | None = None) -> None:
        self.sizes = sizes or {}
        self.calls: list[str] = []
        self.clients: dict[str, FakeClient] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.active = 0
        self.max_active = 0

    def __call__(self, name: str, progress: Callable[[str], None]) -> FakeClient:
        self.calls.append(name)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            progress(f"loading {name}")
            self.gate.wait(10)
            time.sleep(0.02)
            if name.startswith("bad"):
                raise ValueError(f"{name}.gguf: not a GGUF file")
            client = self.clients[name] = FakeClient(name, self.sizes.get(name, GIB))
            return client
        finally:
            self.active -= 1


async def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def names(pool: ModelPool) -> list[str]:
    return [m.name for m in pool.loaded()]


async def test_concurrent_first_requests_share_one_load() -> None:
    loader = FakeLoader()
    pool = ModelPool(loader)
    loader.gate.clear()
    tasks = [asyncio.create_task(pool.acquire("a")) for _ in range(5)]
    await wait_until(lambda: loader.calls == ["a"])
    loader.gate.set()
    leases = await asyncio.gather(*tasks)
    assert loader.calls == ["a"] and pool.loads == 1
    assert {id(lease.client) for lease in leases} == {id(loader.clients["a"])}
    assert pool.find("a").in_use == 5 and pool.find("a:latest") is pool.find("a")
    for lease in leases:
        lease.release()
        lease.release()  # idempotent
    assert pool.find("a").in_use == 0
    await pool.close()
    assert loader.clients["a"].closed


async def test_loads_of_different_models_never_overlap() -> None:
    loader = FakeLoader()
    pool = ModelPool(loader)
    leases = await asyncio.gather(*(pool.acquire(n) for n in "abc"))
    assert sorted(loader.calls) == ["a", "b", "c"] and loader.max_active == 1
    for lease in leases:
        lease.release()
    await pool.close()


async def test_least_recently_used_idle_model_goes_past_max_loaded() -> None:
    loader = FakeLoader()
    pool = ModelPool(loader, max_loaded=2)
    (await pool.acquire("a")).release()
    (await pool.acquire("b")).release()
    (await pool.acquire("a")).release()  # a is now the most recent
    (await pool.acquire("c")).release()
    assert names(pool) == ["c", "a"] and loader.clients["b"].closed
    # a model in use is never unloaded: the pool holds three until one is idle
    held_a = await pool.acquire("a")
    held_c = await pool.acquire("c")
    lease_d = await pool.acquire("d")
    assert sorted(names(pool)) == ["a", "c", "d"]
    held_c.release()  # c idle and least recently used: unloaded to get back to two
    await wait_until(lambda: sorted(names(pool)) == ["a", "d"])
    held_a.release()
    lease_d.release()
    await pool.close()


async def test_memory_budget_unloads_before_the_next_load() -> None:
    loader = FakeLoader({"a": 3 * GIB, "b": 3 * GIB, "c": 2 * GIB})
    sizes = {"a": 3 * GIB, "b": 3 * GIB, "c": 2 * GIB}
    pool = ModelPool(loader, max_loaded=5, memory_budget=7 * GIB, estimate=sizes.get)
    for n in "ab":
        (await pool.acquire(n)).release()
    assert pool.memory_used() == 6 * GIB
    lease = await pool.acquire("c")  # 6 + 2 > 7: a (least recent) goes first
    assert names(pool) == ["c", "b"] and loader.clients["a"].closed
    assert pool.memory_used() == 5 * GIB
    lease.release()
    await pool.close()


async def test_a_model_larger_than_the_budget_is_refused_before_any_load() -> None:
    sizes = {"a": 3 * GIB, "b": 3 * GIB, "huge": 8 * GIB, "liar": GIB}
    loader = FakeLoader({**sizes, "liar": 9 * GIB})  # estimated 1 GiB, measured 9 GiB
    pool = ModelPool(loader, memory_budget=7 * GIB, estimate=sizes.get)
    for n in "ab":
        (await pool.acquire(n)).release()
    with pytest.raises(ModelTooLargeError) as err:
        await pool.acquire("huge")
    assert str(err.value).startswith("model 'huge' needs about 8.0 GiB, more than the whole "
                                     "memory budget of 7.0 GiB")
    assert "raise --memory-budget" in str(err.value)
    assert "huge" not in loader.calls and pool.loads == 2  # refused before loading
    assert names(pool) == ["b", "a"] and not loader.clients["a"].closed
    # larger than its estimate: measured after the load, closed, the others kept
    with pytest.raises(ModelTooLargeError, match=r"'liar' needs about 9\.0 GiB"):
        await pool.acquire("liar")
    assert loader.clients["liar"].closed and names(pool) == ["b", "a"]  # 6 + 1 fitted
    assert not loader.clients["a"].closed and not loader.clients["b"].closed
    await pool.close()


async def test_a_load_waits_for_models_in_use_and_never_unloads_them() -> None:
    sizes = {"a": 3 * GIB, "b": 3 * GIB, "c": 3 * GIB}
    loader = FakeLoader(sizes)
    pool = ModelPool(loader, memory_budget=7 * GIB, estimate=sizes.get, room_timeout=0.3)
    held_a, held_b = await pool.acquire("a"), await pool.acquire("b")
    started = time.monotonic()
    with pytest.raises(ModelBusyError) as err:  # both in use: no room for c, after waiting
        await pool.acquire("c")
    assert time.monotonic() - started >= 0.3 and "c" not in loader.calls
    assert "beside the models in use (a, b)" in str(err.value)
    assert sorted(names(pool)) == ["a", "b"] and not loader.clients["a"].closed
    # c waits while both are busy; once b goes idle, b (not a, in use) makes room
    pool.room_timeout = 5.0
    task = asyncio.create_task(pool.acquire("c"))
    await asyncio.sleep(0.2)
    assert not task.done() and "c" not in loader.calls
    held_b.release()
    lease_c = await asyncio.wait_for(task, 2)
    assert sorted(names(pool)) == ["a", "c"] and loader.clients["b"].closed
    assert not loader.clients["a"].closed
    for lease in (held_a, lease_c):
        lease.release()
    await pool.close()


async def test_keep_alive_expiry_zero_and_forever() -> None:
    pool = ModelPool(FakeLoader(), keep_alive=0.2)
    lease = await pool.acquire("a")
    assert pool.find("a").expires_at() > time.time()
    lease.release()
    (await pool.acquire("b", keep_alive=-1)).release()
    assert pool.find("b").expires_at() is None
    (await pool.acquire("c", keep_alive=0)).release()
    await wait_until(lambda: pool.find("c") is None, timeout=1)  # at once
    await wait_until(lambda: pool.find("a") is None, timeout=2)  # after 0.2 s
    await asyncio.sleep(0.3)
    assert names(pool) == ["b"]
    assert pool.unload("b") and not pool.unload("zzz")
    await wait_until(lambda: not pool.loaded())
    await pool.close()


async def test_expiry_waits_for_requests_in_flight() -> None:
    pool = ModelPool(FakeLoader())
    lease = await pool.acquire("a", keep_alive=0)
    await asyncio.sleep(0.1)
    assert pool.find("a") is not None  # in use
    lease.release()
    await wait_until(lambda: pool.find("a") is None)
    await pool.close()


async def test_failed_load_is_an_error_and_leaves_the_others() -> None:
    loader = FakeLoader()
    pool = ModelPool(loader, max_loaded=2)
    lease = await pool.acquire("a")
    with pytest.raises(ModelLoadError, match=r"'bad' failed to load: bad\.gguf: not a GGUF"):
        await pool.acquire("bad")
    assert names(pool) == ["a"] and not loader.clients["a"].closed
    with pytest.raises(ModelLoadError):  # tried again, not remembered
        await pool.acquire("bad")
    assert loader.calls.count("bad") == 2
    lease.release()
    await pool.close()


async def test_a_pool_without_loader_serves_what_it_was_given() -> None:
    client = FakeClient("given")
    pool = ModelPool(keep_alive=-1)
    pool.add(client, owned=False)
    async with asyncio.timeout(1):
        lease = await pool.acquire("given:latest")
    assert lease.client is client
    lease.release()
    with pytest.raises(UnknownModelError):
        await pool.acquire("other")
    await pool.close()
    assert not client.closed  # not the pool's to close


def test_the_pool_works_across_event_loops() -> None:
    """The chat app's loop and the server's share one pool."""
    pool = ModelPool(FakeLoader())
    first = asyncio.run(pool.acquire("a"))
    second = asyncio.run(pool.acquire("a"))
    assert first.client is second.client
    first.release()
    second.release()
    asyncio.run(pool.close())
