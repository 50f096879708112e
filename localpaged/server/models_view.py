"""How Ollama's model endpoints see the loaded models and the model store (/api/tags, /api/show,
/api/ps, /api/pull). The store is optional: without it, only the loaded models are listed."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from localpaged.engine.client import ModelInfo
from localpaged.engine.model_pool import LoadedModel
from localpaged.server.common import valid_model_name
from localpaged.server.errors import APIError
from localpaged.server.model_leases import find_model
from localpaged.server.streams import ServerState


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


def parameter_size(n: int) -> str:
    """Ollama's short parameter count: 135M, 1.5B, 7B."""
    if n <= 0:
        return ""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            value = n / div
            return f"{value:.1f}{unit}".replace(".0" + unit, unit) if value < 10 else \
                f"{value:.0f}{unit}"
    return str(n)


def _info(client: Any) -> ModelInfo:
    info = getattr(client, "model_info", None)
    return info if info is not None else ModelInfo(name=client.model_name)


def _digest(info: ModelInfo) -> str:
    return info.digest or hashlib.sha256(info.name.encode()).hexdigest()


def details(info: ModelInfo) -> dict[str, Any]:
    return {"parent_model": "", "format": info.format, "family": info.family,
            "families": [info.family], "parameter_size": parameter_size(info.parameter_count),
            "quantization_level": info.quantization}


def _loaded_entry(model: LoadedModel) -> dict[str, Any]:
    info = _info(model.client)
    name = model.name
    return {"name": name, "model": name, "modified_at": _iso(model.loaded_at),
            "size": info.size_bytes, "digest": _digest(info), "details": details(info)}


def _store() -> Any:
    try:
        from localpaged import store
    except ImportError:  # pragma: no cover - the store is part of the package
        return None
    return store if hasattr(store, "list_pulled") else None


def _store_entry(entry: Any) -> dict[str, Any]:
    """A store entry as an /api/tags row (reading whichever attributes it has)."""
    name = str(getattr(entry, "name", entry))
    modified = (getattr(entry, "pulled_at", None) or getattr(entry, "modified_at", None)
                or getattr(entry, "modified", None))
    if isinstance(modified, (int, float)):
        modified = _iso(modified)
    elif isinstance(modified, datetime):
        modified = modified.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")
    elif isinstance(modified, str):
        modified = modified.replace("+00:00", "Z")
    params = getattr(entry, "parameter_count", 0) or 0
    return {"name": name, "model": name, "modified_at": modified or _iso(0),
            "size": int(getattr(entry, "size_bytes", 0) or getattr(entry, "size", 0) or 0),
            "digest": str(getattr(entry, "digest", "") or hashlib.sha256(name.encode()).hexdigest()),
            "details": {"parent_model": "", "format": str(getattr(entry, "format", "") or ""),
                        "family": str(getattr(entry, "family", "") or ""),
                        "families": [str(getattr(entry, "family", "") or "")],
                        "parameter_size": (parameter_size(params) if isinstance(params, int)
                                           else str(params)),
                        "quantization_level": str(getattr(entry, "quantization", "") or "")}}


def _pulled() -> list[Any]:
    store = _store()
    if store is None:
        return []
    try:
        return list(store.list_pulled())
    except Exception:  # a broken registry must not break the loaded models' listing
        return []


def list_models(state: ServerState) -> list[dict[str, Any]]:
    """The loaded models first (most recently used first), then every other pulled model."""
    loaded = state.pool.loaded()
    rows = [_loaded_entry(m) for m in loaded]
    names = {n for m in loaded for n in m.aliases}
    rows += [r for r in map(_store_entry, _pulled()) if r["name"] not in names]
    return rows


def model_ids(state: ServerState) -> list[tuple[str, float]]:
    """(name, created) of every model requests may name: the loaded ones, then the pulled."""
    return [(r["name"], _unix(r["modified_at"])) for r in list_models(state)]


def _unix(iso: str) -> float:
    try:
        return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def running_models(state: ServerState) -> list[dict[str, Any]]:
    """/api/ps: every loaded model, most recently used first, with when it will be unloaded
    (in 2318 for one that stays) and the memory it holds."""
    rows = []
    for model in state.pool.loaded():
        row = _loaded_entry(model)
        info = _info(model.client)
        expires = model.expires_at()
        when = (datetime(2318, 1, 1, tzinfo=timezone.utc) if expires is None
                else datetime.fromtimestamp(expires, timezone.utc))
        size = model.size_bytes or info.size_bytes
        row.update(size=size, expires_at=when.isoformat().replace("+00:00", "Z"),
                   size_vram=size if info.device.startswith("cuda") else 0,
                   context_length=state.bind(model).context_length())
        rows.append(row)
    return rows


def show_model(state: ServerState, name: str) -> dict[str, Any]:
    """/api/show for a loaded model, or a pulled one the store knows (fewer details)."""
    model = find_model(state, name)
    if model is not None:
        state = state.bind(model)
        info = _info(model.client)
        arch = info.architecture
        tok = state.tokenizer
        caps = ["completion"]
        try:
            if tok is not None and tok.fim_ids("a", "b") is not None:
                caps.append("insert")
        except Exception:
            pass
        return {"license": "", "modelfile": f"# served by localpaged\nFROM {info.name}\n",
                "parameters": "", "template": info.chat_template or "",
                "details": details(info),
                "model_info": {"general.architecture": arch,
                               "general.basename": info.name,
                               "general.parameter_count": info.parameter_count,
                               f"{arch}.context_length": state.context_length()},
                "capabilities": caps, "modified_at": _iso(model.loaded_at)}
    if not valid_model_name(name):
        raise APIError(400, f"invalid model name {name!r}")
    for entry in _pulled():
        row = _store_entry(entry)
        if row["name"] == name:
            meta: dict[str, Any] = {"general.basename": name}
            ctx = getattr(entry, "context_length", None)
            if ctx:
                meta["general.context_length"] = ctx
            return {"license": "", "modelfile": f"FROM {name}\n", "parameters": "",
                    "template": getattr(entry, "chat_template", None) or "",
                    "details": row["details"], "model_info": meta,
                    "capabilities": ["completion"], "modified_at": row["modified_at"]}
    raise APIError(404, f"model '{name}' not found")


async def pull_progress(state: ServerState, name: str) -> AsyncIterator[dict[str, Any]]:
    """Ollama-style pull progress lines; the last one is `{"status": "success"}` or an error
    (with a `status_code` key the caller strips)."""
    if find_model(state, name) is not None:
        yield {"status": "pulling manifest"}
        yield {"status": "success"}
        return
    if not valid_model_name(name):
        yield {"error": f"invalid model name {name!r}", "status_code": 400}
        return
    store = _store()
    if store is None or not hasattr(store, "pull"):
        yield {"error": "this server has no model store to pull from", "status_code": 501}
        return
    yield {"status": "pulling manifest"}
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    succeeded = False

    def progress(*args: Any, **kwargs: Any) -> None:
        nonlocal succeeded
        line = _progress_line(name, args, kwargs)
        succeeded = succeeded or line["status"] == "success"
        loop.call_soon_threadsafe(queue.put_nowait, line)

    not_found = getattr(store, "UnknownModelError", LookupError)
    bad_download = getattr(store, "IntegrityError", OSError)

    def run() -> None:
        line: dict[str, Any] | None = None
        try:
            store.pull(name, progress=progress)
            if not succeeded:
                line = {"status": "success"}
        except bad_download as exc:
            line = {"error": f"pull {name} failed: {exc}", "status_code": 502}
        except (not_found, LookupError, FileNotFoundError) as exc:
            line = {"error": f"pull {name}: {exc}", "status_code": 404}
        except ValueError as exc:
            line = {"error": f"pull {name}: {exc}", "status_code": 400}
        except Exception as exc:  # unreachable sources, full disk: the upstream failed
            line = {"error": f"pull {name} failed: {exc}", "status_code": 502}
        if line is not None:
            loop.call_soon_threadsafe(queue.put_nowait, line)
        loop.call_soon_threadsafe(queue.put_nowait, None)

    threading.Thread(target=run, name=f"pull-{name}", daemon=True).start()
    while (line := await queue.get()) is not None:
        yield line


def _progress_line(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """One progress callback call as an Ollama progress line, whatever shape the store uses:
    a dict, (completed, total), (file, completed, total) or an object with those attributes."""
    if args and isinstance(args[0], dict):
        data = dict(args[0])
    elif len(args) >= 3:
        data = {"file": args[0], "completed": args[1], "total": args[2]}
    elif len(args) == 2:
        data = {"completed": args[0], "total": args[1]}
    elif args:
        obj = args[0]
        data = {k: getattr(obj, k) for k in ("file", "filename", "completed", "downloaded",
                                             "total", "status") if hasattr(obj, k)}
    else:
        data = {}
    data.update(kwargs)
    completed = data.get("completed", data.get("downloaded"))
    total = data.get("total")
    file = data.get("file") or data.get("filename") or name
    line: dict[str, Any] = {"status": str(data.get("status") or f"pulling {file}")}
    if data.get("file") or data.get("filename"):
        line["digest"] = "sha256:" + hashlib.sha256(str(file).encode()).hexdigest()
    if isinstance(total, int) and total > 0:
        line["total"] = total
        if isinstance(completed, int):
            line["completed"] = completed
    return line
