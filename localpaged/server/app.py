"""The localhost HTTP API: `create_app` builds it on any EngineClient, `serve_in_background`
runs it next to the chat UI, and `main` is `localpaged serve`."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse
from starlette.middleware.cors import CORSMiddleware

from localpaged.engine.client import EngineClient, EngineStats
from localpaged.engine.model_pool import (
    DEFAULT_KEEP_ALIVE,
    DEFAULT_MAX_LOADED,
    ModelPool,
    default_memory_budget,
)
from localpaged.server import ollama_routes, openai_routes
from localpaged.server.errors import install_error_handlers
from localpaged.server.metrics import render_metrics
from localpaged.server.model_leases import LeaseMiddleware
from localpaged.server.security import (
    DEFAULT_MAX_BODY_BYTES,
    GuardMiddleware,
    cors_origin_regex,
    is_loopback_host,
)
from localpaged.server.streams import ServerState

DEFAULT_MAX_QUEUED = 128
API_KEY_ENV = "LOCALPAGED_API_KEY"


def create_app(client: EngineClient | None = None, *, pool: ModelPool | None = None,
               loadable: Callable[[], list[str]] | None = None,
               allowed_hosts: tuple[str, ...] | list[str] = (),
               allowed_origins: tuple[str, ...] | list[str] = (), api_key: str | None = None,
               max_queued: int = DEFAULT_MAX_QUEUED,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               allow_ip_hosts: bool = False) -> FastAPI:
    """The API over `client` (which the caller owns and closes: the one model served), or
    over `pool`, whose models requests name (the caller owns and closes the pool too).

    loadable lists the names the pool may load on demand (default: the models pulled into
    the store, where the pool has a loader); allowed_hosts / allowed_origins extend the
    loopback defaults; api_key, when set, is required as `Authorization: Bearer <key>`;
    max_queued caps generation requests in flight (429 past it); max_body_bytes caps request
    bodies (413 past it); allow_ip_hosts accepts any IP literal as Host (for a server bound
    beyond loopback).
    """
    app = FastAPI(
        title="localpaged", version="0.1.0",
        summary="OpenAI-compatible API of a local paged-KV engine "
                "(an Ollama-compatible API is served under /api, outside this document).",
        docs_url=None, redoc_url=None, openapi_url="/openapi.json")  # no CDN-loaded doc pages
    if pool is None:
        if client is None:
            raise TypeError("create_app needs a client or a pool")
        pool = ModelPool()
        pool.add(client, owned=False, pinned=True)
    if loadable is None and pool.can_load:
        loadable = pulled_names
    app.state.localpaged = ServerState(pool=pool, max_queued=max_queued, loadable=loadable)
    install_error_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(ollama_routes.router)

    @app.get("/", include_in_schema=False, response_class=PlainTextResponse)
    @app.head("/", include_in_schema=False, response_class=PlainTextResponse)
    async def root() -> str:
        return "Ollama is running"  # what Ollama clients probe for

    @app.get("/metrics", include_in_schema=False, response_class=PlainTextResponse)
    async def metrics(request: Request) -> PlainTextResponse:
        state: ServerState = request.app.state.localpaged
        recent = state.pool.loaded()  # the most recently used model's engine
        stats = recent[0].client.stats() if recent else EngineStats(model="", device="")
        return PlainTextResponse(render_metrics(stats, state.metrics),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    def openapi() -> dict[str, Any]:
        """FastAPI's document, less its 422 answers: validation errors here are 400s."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary,
                                 routes=app.routes)
            for ops in schema.get("paths", {}).values():
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_middleware(CORSMiddleware, allow_origin_regex=cors_origin_regex(allowed_origins),
                       allow_methods=["*"], allow_headers=["*"], max_age=600)
    app.add_middleware(GuardMiddleware, allowed_hosts=allowed_hosts,
                       allowed_origins=allowed_origins, api_key=api_key,
                       max_body_bytes=max_body_bytes, allow_ip_hosts=allow_ip_hosts)
    app.add_middleware(LeaseMiddleware)
    return app


def pulled_names() -> list[str]:
    """The names of the models pulled into the store (empty if it cannot be read)."""
    try:
        from localpaged import store

        return [m.name for m in store.list_pulled()]
    except Exception:  # a broken registry: nothing to load on demand
        return []


@dataclass
class ServerHandle:
    """A server running on a background thread; `stop()` shuts it down."""

    server: uvicorn.Server
    thread: threading.Thread
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def serve_in_background(client: EngineClient | None = None, host: str = "127.0.0.1",
                        port: int = 0, **app_kwargs: Any) -> ServerHandle:
    """Serve `create_app(client, **app_kwargs)` (or over `pool=`) with uvicorn on a daemon
    thread (its own event loop; engine clients and the pool are safe to use from any loop).
    port 0 picks a free port. Returns once the server listens."""
    if not is_loopback_host(host):
        app_kwargs.setdefault("allow_ip_hosts", True)
    app = create_app(client, **app_kwargs)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            lifespan="off", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # not main thread
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(server.serve())
        except BaseException as exc:  # reported to the caller below
            errors.append(exc)

    thread = threading.Thread(target=run, name="localpaged-api", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if errors or not thread.is_alive():
            raise RuntimeError(f"the API server did not start on {host}:{port}: "
                               f"{errors[0] if errors else 'it exited'}")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the API server did not start on {host}:{port} in 30 s")
        time.sleep(0.01)
    sock_port = port
    for s in server.servers:
        for sock in s.sockets:
            sock_port = sock.getsockname()[1]
            break
    return ServerHandle(server, thread, host, sock_port)


def main(args: argparse.Namespace) -> int:
    """`localpaged serve`: load the model named (it stays loaded), then serve it and, on
    demand, any pulled model requests name, until Ctrl-C."""
    from localpaged.cli import DEFAULT_MODEL
    from localpaged.engine.async_engine import LocalClient
    from localpaged.server.ollama_routes import parse_keep_alive

    engine_args = {k: getattr(args, k) for k in ("dtype", "device", "max_model_len", "kv_cache_gb", "kv_cache_dtype", "max_step_ms")
                   if getattr(args, k, None) is not None}
    first = args.model or DEFAULT_MODEL
    max_loaded = getattr(args, "max_loaded_models", None)
    max_loaded = DEFAULT_MAX_LOADED if max_loaded is None else max_loaded
    gb = getattr(args, "memory_budget", None)
    try:
        keep_alive = parse_keep_alive(getattr(args, "keep_alive", None))
        if max_loaded < 1 or (gb is not None and not gb > 0):
            raise ValueError("--max-loaded-models and --memory-budget must be positive")
    except ValueError as exc:
        print(f"localpaged: {exc}", file=sys.stderr)
        return 2
    budget = int(gb * 2**30) if gb else default_memory_budget(engine_args.get("device"))
    sources: dict[str, str] = {}  # served names of the model named at start -> its argument

    def load(name: str, progress: Callable[[str], None]) -> EngineClient:
        return LocalClient.from_model(sources.get(name, name), **engine_args)

    pool = ModelPool(load, max_loaded=max_loaded, memory_budget=budget,
                     keep_alive=DEFAULT_KEEP_ALIVE if keep_alive is None else keep_alive,
                     estimate=pulled_size)
    client = LocalClient.from_model(first, **engine_args)
    started = pool.add(client, keep_alive=-1)  # stays loaded unless a request says otherwise
    sources.update(dict.fromkeys(started.aliases, first))
    beyond_loopback = not is_loopback_host(args.host)
    if beyond_loopback:
        print(f"localpaged: warning: serving on {args.host}, not only this machine; set "
              f"{API_KEY_ENV} to require a key", file=sys.stderr)
    app = create_app(pool=pool, loadable=lambda: [*pulled_names(), *sources],
                     allowed_hosts=list(args.allowed_host or []),
                     allowed_origins=args.allowed_origin or [],
                     api_key=os.environ.get(API_KEY_ENV) or None,
                     allow_ip_hosts=beyond_loopback)
    limit = f", memory budget {budget / 2**30:.1f} GiB" if budget else ""
    print(f"localpaged: serving {client.model_name} on http://{args.host}:{args.port} "
          f"(OpenAI: /v1, Ollama: /api); other pulled models load on demand, up to "
          f"{pool.max_loaded} at once{limit}", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info",
                    timeout_graceful_shutdown=2)
    finally:
        asyncio.run(pool.close())
    return 0


def pulled_size(name: str) -> int:
    """The size on disk of a pulled model (0 if unknown): its memory before it is loaded."""
    try:
        from localpaged import store

        return next((m.size_bytes for m in store.list_pulled() if m.name == name), 0)
    except Exception:
        return 0
