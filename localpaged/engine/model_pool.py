"""ModelPool: the models loaded at once, shared by the HTTP API and the chat app.

Requests lease a model by name (`acquire`): a loaded one at once, else it is loaded on
demand by the pool's loader on a thread of its own. Loads are one at a time, and concurrent
requests for the same model wait on the same load. A model with leases out is in use; once
idle it stays loaded for its keep-alive (Ollama's: 5 minutes by default, negative for ever, 0
unloads as soon as it is idle), and the least recently used idle models are unloaded to keep
at most `max_loaded` models and their memory within `memory_budget`.

A model larger than the whole budget is refused before anything is unloaded
(`ModelTooLargeError`). One that fits the budget but not beside the models in use waits, as
Ollama's scheduler does, until enough of them are idle to be unloaded (a model in use never
is), for at most `room_timeout` seconds (`ModelBusyError` past it).

The pool is free of any event loop: its state is guarded by a thread lock, loads run on
threads and expiries on a reaper thread, so the chat app's loop and the server's can share it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from localpaged.engine.client import EngineClient

log = logging.getLogger(__name__)

Progress = Callable[[str], None]
Loader = Callable[[str, Progress], EngineClient]  # model name, progress -> client (blocking)

DEFAULT_KEEP_ALIVE = 300.0  # seconds, as Ollama
DEFAULT_MAX_LOADED = 3  # as Ollama (per GPU; one here)
DEFAULT_ROOM_TIMEOUT = 300.0  # seconds a load waits for models in use to free memory (Ollama's
# OLLAMA_LOAD_TIMEOUT is 5 minutes too)


class UnknownModelError(LookupError):
    """A name the pool has not loaded and cannot load (it has no loader)."""


class ModelLoadError(RuntimeError):
    """The loader failed; the message names the model and the cause."""


def format_bytes(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class ModelTooLargeError(ModelLoadError):
    """A model larger than the whole memory budget: it cannot load even alone, so nothing
    loaded is unloaded for it."""

    def __init__(self, name: str, size: int, budget: int) -> None:
        self.name, self.size, self.budget = name, size, budget
        super().__init__(
            f"model {name!r} needs about {format_bytes(size)}, more than the whole memory "
            f"budget of {format_bytes(budget)}, so it cannot be loaded (nothing was unloaded "
            "for it): raise --memory-budget, free memory, or use a smaller model or "
            "quantization")


class ModelBusyError(ModelLoadError):
    """No room for a model within the memory budget while the models in use hold it, after
    waiting `room_timeout` seconds for them to go idle."""

    def __init__(self, name: str, size: int, budget: int, busy: list[str], waited: float
                 ) -> None:
        self.name, self.size, self.budget, self.busy = name, size, budget, busy
        super().__init__(
            f"model {name!r} (about {format_bytes(size)}) does not fit in the memory budget "
            f"of {format_bytes(budget)} beside the models in use ({', '.join(busy)}); waited "
            f"{waited:.0f} s for them to finish: retry later, or raise --memory-budget")


def _no_progress(text: str) -> None:
    pass


@dataclass(eq=False)
class LoadedModel:
    """One loaded model: its client, what it holds in memory, and when it goes."""

    name: str  # the name it was loaded under (the pool's key)
    client: EngineClient
    size_bytes: int = 0  # memory it holds (weights and KV cache), as measured at load
    default_keep_alive: float = DEFAULT_KEEP_ALIVE  # when a lease names none
    keep_alive: float = DEFAULT_KEEP_ALIVE  # seconds idle before unloading; < 0: never
    owned: bool = True  # the pool closes the client when it unloads it
    pinned: bool = False  # never unloaded (a server's one given client)
    loaded_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    in_use: int = 0  # leases out
    waiters: int = 0  # requests waiting on its load, not yet leased
    aliases: set[str] = field(default_factory=set)

    @property
    def idle(self) -> bool:
        return self.in_use == 0 and self.waiters == 0

    @property
    def evictable(self) -> bool:
        return self.idle and not self.pinned

    def deadline(self) -> float | None:
        """When (time.monotonic) it unloads if still idle; None: never."""
        if self.keep_alive < 0 or self.pinned:
            return None
        return self.last_used + self.keep_alive

    def expires_at(self) -> float | None:
        """The unload time as a Unix time (counted from now while in use); None: never."""
        if self.keep_alive < 0 or self.pinned:
            return None
        if not self.idle:
            return time.time() + self.keep_alive
        return time.time() + max(0.0, self.last_used + self.keep_alive - time.monotonic())


class Lease:
    """A model held for one request (or one chat app model); `release()` is idempotent."""

    def __init__(self, pool: ModelPool, model: LoadedModel) -> None:
        self.pool = pool
        self.model = model
        self._released = False

    @property
    def client(self) -> EngineClient:
        return self.model.client

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.pool._release(self.model)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def client_memory(client: EngineClient) -> int:
    """Bytes an in-process client reports it holds (weights and KV pool), 0 if it says none."""
    engine = getattr(client, "engine", None)
    return int(getattr(engine, "weights_bytes", 0) or 0) + int(getattr(engine, "kv_bytes", 0) or 0)


def served_aliases(client: EngineClient) -> set[str]:
    """The names a client answers to: its own, its model's, and with `:latest` when untagged."""
    names = {client.model_name}
    info = getattr(client, "model_info", None)
    if info is not None and info.name:
        names.add(info.name)
    return names | {f"{n}:latest" for n in names if ":" not in n.rsplit("/", 1)[-1]}


class ModelPool:
    """Loaded models by name, loaded on demand, unloaded by expiry and least recent use.

    loader: builds a client for a name (blocking, run on a thread); None for a pool of clients
    given with `add` only. max_loaded: models kept at once. memory_budget: bytes all loaded
    models may hold (None: no limit). keep_alive: seconds an idle model stays (negative: for
    ever). estimate: a model's bytes before it is loaded (to make room first), 0 if unknown.
    room_timeout: seconds a load waits for models in use to go idle when only their
    unloading would make room within the budget.
    """

    def __init__(self, loader: Loader | None = None, *, max_loaded: int = DEFAULT_MAX_LOADED,
                 memory_budget: int | None = None, keep_alive: float = DEFAULT_KEEP_ALIVE,
                 estimate: Callable[[str], int] | None = None,
                 room_timeout: float = DEFAULT_ROOM_TIMEOUT) -> None:
        if max_loaded < 1:
            raise ValueError(f"max_loaded={max_loaded} is invalid: expected >= 1")
        self.loader = loader
        self.max_loaded = max_loaded
        self.memory_budget = memory_budget
        self.keep_alive = keep_alive
        self.estimate = estimate
        self.room_timeout = room_timeout
        self.loads = 0  # loads started (for tests and /metrics)
        self._models: dict[str, LoadedModel] = {}  # least recently used first
        self._loading: dict[str, concurrent.futures.Future[LoadedModel]] = {}
        self._waiting: dict[str, int] = {}  # callers waiting on each load
        self._load_gate = threading.Lock()  # one load at a time
        self._cond = threading.Condition()  # guards the dicts; wakes the reaper
        self._closed = False
        self._reaper: threading.Thread | None = None

    # -- what is loaded ------------------------------------------------------------------
    def find(self, name: str) -> LoadedModel | None:
        """The loaded model answering to `name`, or None."""
        with self._cond:
            return self._find(name)

    def loaded(self) -> list[LoadedModel]:
        """The loaded models, most recently used first."""
        with self._cond:
            return list(reversed(self._models.values()))

    def memory_used(self) -> int:
        with self._cond:
            return sum(m.size_bytes for m in self._models.values())

    @property
    def can_load(self) -> bool:
        return self.loader is not None

    def _find(self, name: str) -> LoadedModel | None:
        if name in self._models:
            return self._models[name]
        return next((m for m in self._models.values() if name in m.aliases), None)

    # -- leasing -------------------------------------------------------------------------
    def add(self, client: EngineClient, *, name: str | None = None,
            keep_alive: float | None = None, owned: bool = True, pinned: bool = False,
            size_bytes: int | None = None) -> LoadedModel:
        """Put an already loaded client in the pool (under `name`, default its model name).
        keep_alive: its default keep-alive (the pool's if None); owned: the pool closes it;
        pinned: it is never unloaded."""
        ka = self.keep_alive if keep_alive is None else keep_alive
        model = LoadedModel(name or client.model_name, client,
                            client_memory(client) if size_bytes is None else size_bytes,
                            default_keep_alive=ka, keep_alive=ka, owned=owned, pinned=pinned)
        model.aliases = served_aliases(client) | {model.name}
        with self._cond:
            if self._closed:
                raise RuntimeError("the model pool is closed")
            self._models[model.name] = model
            self._start_reaper()
            self._cond.notify_all()
        return model

    async def acquire(self, name: str, keep_alive: float | None = None,
                      progress: Progress | None = None) -> Lease:
        """Lease the model `name`, loading it first if needed (concurrent callers share one
        load). keep_alive: seconds it stays once idle (None: its default). Raises
        UnknownModelError for a name the pool cannot load, ModelLoadError if the load fails
        (ModelTooLargeError, before any load, for a model larger than the whole budget;
        ModelBusyError when the models in use hold the memory past `room_timeout`)."""
        if self.loader is not None and self.memory_budget is not None and self.find(name) is None:
            size = self._estimate(name)
            if size > self.memory_budget:
                raise ModelTooLargeError(name, size, self.memory_budget)
        while True:
            with self._cond:
                if self._closed:
                    raise RuntimeError("the model pool is closed")
                model = self._find(name)
                if model is not None:
                    return self._lease(model, keep_alive)
                if self.loader is None:
                    raise UnknownModelError(name)
                future = self._loading.get(name)
                if future is None:
                    future = concurrent.futures.Future()
                    self._loading[name] = future
                    self.loads += 1
                    threading.Thread(target=self._load, args=(name, future, progress),
                                     name=f"localpaged-load-{name}", daemon=True).start()
                self._waiting[name] = self._waiting.get(name, 0) + 1
            try:
                model = await asyncio.wrap_future(future)
            except BaseException:
                with self._cond:
                    self._stop_waiting(name)
                raise
            with self._cond:
                self._stop_waiting(name)
                if self._models.get(model.name) is model:
                    return self._lease(model, keep_alive)
            # unloaded again before this caller got it (closed meanwhile): load again

    def _stop_waiting(self, name: str) -> None:
        """(under the lock) One caller no longer waits on the load of `name`."""
        self._waiting[name] -= 1
        if not self._waiting[name]:
            del self._waiting[name]
        if (model := self._models.get(name)) is not None and model.waiters:
            model.waiters -= 1
            model.last_used = time.monotonic()
        self._cond.notify_all()

    def _lease(self, model: LoadedModel, keep_alive: float | None) -> Lease:
        """(under the lock) A lease of `model`; it becomes the most recently used."""
        model.in_use += 1
        model.keep_alive = model.default_keep_alive if keep_alive is None else keep_alive
        model.last_used = time.monotonic()
        self._models[model.name] = self._models.pop(model.name)
        return Lease(self, model)

    def _release(self, model: LoadedModel) -> None:
        with self._cond:
            model.in_use -= 1
            model.last_used = time.monotonic()
            self._cond.notify_all()  # the reaper: expiry (keep_alive 0) and limits

    def unload(self, name: str) -> bool:
        """Unload `name` as soon as it is idle (now if it is); False if it is not loaded."""
        with self._cond:
            model = self._find(name)
            if model is None:
                return False
            if model.pinned:
                return True
            model.keep_alive = 0.0
            model.last_used = time.monotonic()
            self._cond.notify_all()
        return True

    # -- loading -------------------------------------------------------------------------
    def _load(self, name: str, future: concurrent.futures.Future[LoadedModel],
              progress: Progress | None) -> None:
        """(load thread) Make room, load, measure, then trim to the limits."""
        try:
            with self._load_gate:
                assert self.loader is not None
                self._close_all(self._make_room(name, self._estimate(name)))
                before = _resident()
                try:
                    client = self.loader(name, progress or _no_progress)
                except Exception as exc:
                    raise ModelLoadError(f"model {name!r} failed to load: {exc}") from exc
                grown = _resident() - before if before else 0
                size = client_memory(client) or max(0, grown)
                if self._closed:  # closed while it loaded: nobody will unload it later
                    asyncio.run(client.close())
                    raise RuntimeError("the model pool is closed")
                if self.memory_budget is not None and size > self.memory_budget:
                    asyncio.run(client.close())  # larger than estimated: keep the others
                    raise ModelTooLargeError(name, size, self.memory_budget)
                with self._cond:
                    model = LoadedModel(name, client, size, default_keep_alive=self.keep_alive,
                                        keep_alive=self.keep_alive)
                    model.aliases = served_aliases(client) | {name}
                    model.waiters = self._waiting.get(name, 0)
                    self._models[name] = model
                    self._start_reaper()
                    extra = self._over_limits()
                self._close_all(extra)
            log.info("loaded %s (%.2f GiB)", name, size / 2**30)
        except BaseException as exc:
            self._load_done(name)  # a failed load is not remembered: the next request tries again
            future.set_exception(exc)
        else:
            self._load_done(name)
            future.set_result(model)

    def _load_done(self, name: str) -> None:
        with self._cond:
            self._loading.pop(name, None)
            self._cond.notify_all()

    def _estimate(self, name: str) -> int:
        try:
            return int(self.estimate(name)) if self.estimate is not None else 0
        except Exception:
            return 0

    def _make_room(self, name: str, incoming: int) -> list[LoadedModel]:
        """Idle models to unload (least recently used first) so that one more model of
        `incoming` bytes fits; they leave the pool now. Where only models in use hold the
        memory it needs, waits for them to go idle (ModelBusyError past `room_timeout`)."""
        start = time.monotonic()
        with self._cond:
            if self.memory_budget is not None and incoming > self.memory_budget:
                raise ModelTooLargeError(name, incoming, self.memory_budget)  # never fits
            while True:
                victims = self._room_for(incoming)
                if victims is not None:
                    for model in victims:
                        del self._models[model.name]
                    return victims
                if self._closed:
                    raise RuntimeError("the model pool is closed")
                waited = time.monotonic() - start
                if waited >= self.room_timeout:
                    busy = [m.name for m in self._models.values() if not m.evictable]
                    assert self.memory_budget is not None
                    raise ModelBusyError(name, incoming, self.memory_budget, busy, waited)
                self._cond.wait(self.room_timeout - waited)

    def _room_for(self, incoming: int) -> list[LoadedModel] | None:
        """(under the lock) The idle models, least recently used first, whose unloading lets
        one more model of `incoming` bytes in; None while the models that may not be unloaded
        (in use, pinned) leave it no room in the budget. Past the count only, it loads anyway
        and the extra one goes once idle."""
        victims: list[LoadedModel] = []
        count = len(self._models)
        used = sum(m.size_bytes for m in self._models.values())

        def fits_memory() -> bool:
            return self.memory_budget is None or used + incoming <= self.memory_budget

        for model in self._models.values():
            if count < self.max_loaded and fits_memory():
                return victims
            if model.evictable:
                victims.append(model)
                count -= 1
                used -= model.size_bytes
        return victims if fits_memory() else None

    def _over_limits(self) -> list[LoadedModel]:
        """(under the lock) Idle models to unload, least recently used first, while the pool
        holds more than it may; they leave the pool now."""
        victims: list[LoadedModel] = []
        for model in list(self._models.values()):
            used = sum(m.size_bytes for m in self._models.values())
            over = len(self._models) > self.max_loaded or (
                self.memory_budget is not None and used > self.memory_budget)
            if not over:
                break
            if model.evictable and len(self._models) > 1:
                victims.append(self._models.pop(model.name))
        return victims

    # -- unloading -----------------------------------------------------------------------
    def _start_reaper(self) -> None:
        """(under the lock) The thread that unloads expired models, started once."""
        if self._reaper is None:
            self._reaper = threading.Thread(target=self._reap, name="localpaged-model-reaper",
                                            daemon=True)
            self._reaper.start()

    def _reap(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                expired = [m for m in self._models.values() if m.evictable and
                           (d := m.deadline()) is not None and d <= now]
                for m in expired:
                    del self._models[m.name]
                expired += self._over_limits()
                if not expired:
                    deadlines = [d for m in self._models.values()
                                 if m.evictable and (d := m.deadline()) is not None]
                    self._cond.wait(min(deadlines) - now if deadlines else None)
                    continue
            self._close_all(expired)

    def _close_all(self, models: list[LoadedModel]) -> None:
        for model in models:
            log.info("unloading %s", model.name)
            if model.owned:
                try:
                    asyncio.run(model.client.close())
                except Exception:
                    log.exception("closing %s failed", model.name)

    async def close(self) -> None:
        """Unload every model (the owned ones are closed) and stop the reaper."""
        with self._cond:
            self._closed = True
            models = list(self._models.values())
            self._models.clear()
            self._cond.notify_all()
        for model in models:
            if model.owned:
                await model.client.close()


def _resident() -> int:
    from localpaged.engine.loading import resident_bytes

    return resident_bytes() or 0


BUDGET_SHARE = 0.9  # of the memory free at start that loaded models may hold by default


def default_memory_budget(device: str | None = None) -> int | None:
    """The memory budget when none is given: 90% of the memory free now (the GPU's on CUDA,
    else the machine's available RAM); None where it cannot be read."""
    from localpaged.engine.config import EngineArgs, available_memory

    if EngineArgs(model="", device=device).resolved_device().startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info()
        return int(BUDGET_SHARE * free)
    available = available_memory()
    return None if available is None else int(BUDGET_SHARE * available)
