"""`localpaged chat`: choose the engine client, then run the Textual app.

- `--remote URL`: an OpenAI-compatible server (RemoteClient).
- A localpaged server already answering on `--port` (and no `--local`/`--serve`): attach to
  it, as Ollama's CLI does, so terminals and editors share one model.
- Otherwise the in-process engine (LocalClient), loaded by the app in a thread with progress
  (the default model is pulled on first use); `--serve` also serves the localhost API over the
  app's pool of loaded models.

This module sits outside `localpaged.tui` and `localpaged.server` so that neither imports the
other; it reaches the server through importlib.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from localpaged.engine.client import EngineClient
from localpaged.engine.model_pool import ModelPool
from localpaged.engine.remote import RemoteClient
from localpaged.tui.app import KEPT_MODELS, ChatApp
from localpaged.tui.history import History

DEFAULT_MODEL = "smollm2:135m"
LOCALHOST = "127.0.0.1"


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """The `LocalClient.from_model` keyword arguments given on the command line."""
    keys = ("dtype", "device", "max_model_len", "kv_cache_gb", "kv_cache_dtype", "max_step_ms")
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def server_running(port: int, host: str = LOCALHOST, connect_timeout: float = 0.5,
                   answer_timeout: float = 5.0) -> bool:
    """Whether a localpaged server answers on host:port (its public /api/version). Nothing
    listening is known at once; a server that took the connection gets `answer_timeout` to
    answer (one busy loading or generating on a loaded machine can take seconds, and taking it
    for absent would start a second engine with a second copy of the model)."""
    timeout = httpx.Timeout(answer_timeout, connect=connect_timeout)
    try:
        resp = httpx.get(f"http://{host}:{port}/api/version", timeout=timeout)
    except httpx.HTTPError:
        return False
    return resp.status_code == 200


def make_loader(kwargs: dict[str, Any],
                on_loaded: Callable[[EngineClient], None] | None = None
                ) -> Callable[[str, Callable[[str], None]], EngineClient]:
    """A function that builds a LocalClient for a model name (pulling it first if needed)."""

    def load(model: str, progress: Callable[[str], None]) -> EngineClient:
        from localpaged.engine.async_engine import LocalClient

        _pull_if_needed(model, progress)
        progress(f"loading {model}…")
        client = LocalClient.from_model(model, **kwargs)
        if on_loaded is not None:
            on_loaded(client)
        return client

    return load


def _pull_if_needed(model: str, progress: Callable[[str], None]) -> None:
    """Pull a catalog model not on disk yet, reporting progress (paths are used as they are)."""
    if Path(model).expanduser().exists():
        return
    try:
        store = importlib.import_module("localpaged.store")
    except ImportError:
        return
    pulled = getattr(store, "list_pulled", None)
    pull = getattr(store, "pull", None)
    if pulled is None or pull is None:
        return
    if model in {_name(m) for m in pulled()}:
        return

    def report(event: Any) -> None:
        progress(f"pulling {model}: {_progress_text(event)}")

    progress(f"pulling {model}…")
    pull(model, progress=report)


def _progress_text(event: Any) -> str:
    """`PullProgress` as text: status, and the share done when the total is known."""
    status = str(getattr(event, "status", event))
    done, total = getattr(event, "completed", 0), getattr(event, "total", 0)
    return f"{status} {done / total:.0%}" if total else status


def _name(entry: Any) -> str:
    return str(getattr(entry, "name", entry))


def list_pulled_models() -> list[str]:
    """Names of pulled models for the command palette (empty if the store is unavailable)."""
    try:
        store = importlib.import_module("localpaged.store")
        return sorted(_name(m) for m in store.list_pulled())
    except (ImportError, AttributeError):
        return []


def start_server(port: int, pool: ModelPool) -> Callable[[EngineClient], None]:
    """`--serve`: once the first model is loaded, serve the localhost API over the app's pool
    (requests name its models, or load other pulled ones into it)."""
    started: list[bool] = []

    def serve(client: EngineClient) -> None:
        if started:
            return
        server = importlib.import_module("localpaged.server.app")
        server.serve_in_background(pool=pool, host=LOCALHOST, port=port,
                                   api_key=os.environ.get("LOCALPAGED_API_KEY") or None)
        started.append(True)

    return serve


def build_app(args: argparse.Namespace, history: History) -> ChatApp:
    """The app for `localpaged chat` arguments: remote, attached or in-process engine."""
    model = getattr(args, "model", None)
    port = int(getattr(args, "port", 11435))
    if args.remote:
        api_key = os.environ.get("LOCALPAGED_API_KEY") or os.environ.get("OPENAI_API_KEY")
        return ChatApp(history, client=RemoteClient(args.remote, api_key=api_key, model=model))
    if not args.local and not args.serve and server_running(port):
        url = f"http://{LOCALHOST}:{port}/v1"
        key = os.environ.get("LOCALPAGED_API_KEY")
        return ChatApp(history, client=RemoteClient(url, api_key=key, model=model))
    def on_loaded(client: EngineClient) -> None:
        serve(client)  # --serve: the API over the app's pool, from the first load on

    loader = make_loader(engine_args(args), on_loaded if args.serve else None)
    pool = ModelPool(loader, max_loaded=KEPT_MODELS, keep_alive=-1)
    serve = start_server(port, pool)
    return ChatApp(history, model=model or DEFAULT_MODEL, loader=loader, pool=pool,
                   list_models=list_pulled_models)


def main(args: argparse.Namespace) -> int:
    """Run `localpaged chat` with parsed arguments."""
    history = History.in_data_dir()
    try:
        build_app(args, history).run()
    finally:
        history.close()
    return 0
