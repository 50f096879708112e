"""Loading and switching models from the app, and remote servers (errors stay in their tab)."""

from __future__ import annotations

import argparse
import asyncio
import http.server
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from textual.command import CommandList
from textual.pilot import Pilot

from localpaged import chat_launcher
from localpaged.cli import build_parser
from localpaged.engine.remote import RemoteClient
from localpaged.tui.app import ChatApp
from localpaged.tui.history import History
from localpaged.tui.main_screen import ChatScreen
from localpaged.tui.session import ChatSettings

SIZE = (110, 32)


async def wait_for(pilot: Pilot, cond: Callable[[], bool], timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not reached in time"
        await pilot.pause(0.05)


def palette_top(app: ChatApp) -> str:
    """The highlighted command of the open command palette ("" while there is none)."""
    lists = app.screen.query(CommandList)
    option = lists.first().highlighted_option if lists else None
    return str(option.prompt) if option is not None else ""


def chat(app: ChatApp) -> ChatScreen:
    screen = app._chat_screen()
    assert screen is not None
    return screen


def status(app: ChatApp) -> str:
    chat(app).refresh_status()
    return str(chat(app).query_one("#status").content)


async def test_load_at_start_then_a_failed_switch_leaves_the_app_usable(
        tmp_path: Path, tiny_chat_model: Path) -> None:
    load = chat_launcher.make_loader({"dtype": "float32", "device": "cpu",
                                      "num_kv_blocks": 64, "max_model_len": 256})
    go = threading.Event()

    def loader(model: str, progress: Callable[[str], None]):
        go.wait(30)  # hold the load until the test has looked at the app while loading
        return load(model, progress)

    bad = str(tmp_path / "missing" / "model.gguf")
    app = ChatApp(History(tmp_path / "h.sqlite3"), model=str(tiny_chat_model), loader=loader,
                  list_models=lambda: [str(tiny_chat_model), bad],
                  default_settings=ChatSettings(temperature=0, max_tokens=4))
    async with app.run_test(size=SIZE) as pilot:
        assert app.client is None and "loading" in status(app)
        view = chat(app).current
        assert view is not None
        assert not view.send("too early")  # no model yet: nothing sent, the text stays
        go.set()
        await wait_for(pilot, lambda: app.client is not None and app.loading is None)
        assert status(app).startswith(f"{tiny_chat_model.name} · cpu")
        # switch through the command palette to a model that cannot load
        await pilot.press("ctrl+p")
        await pilot.press(*"Switch model: ")
        await pilot.press(*"missing")
        await wait_for(pilot, lambda: palette_top(app).startswith("Switch model")
                       and "missing" in palette_top(app))
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.load_error is not None)
        assert "failed to load" in status(app)
        assert any("Could not load" in str(n.message) for n in app._notifications)
        # the old engine still answers
        assert view.send("still here")
        await wait_for(pilot, lambda: not view.session.busy and len(view.session.messages) == 2)
        assert view.session.messages[-1].status == "done"
    assert app.client is not None  # closed with the app (it owns the client)


async def test_remote_errors_stay_in_their_tab(tmp_path: Path, openai_stub) -> None:
    client = RemoteClient(openai_stub.url, model="echo")
    app = ChatApp(History(tmp_path / "h.sqlite3"), client=client)
    async with app.run_test(size=SIZE) as pilot:
        s = chat(app)
        first = s.current
        assert first is not None and first.send("!error please")
        await pilot.press("ctrl+t")
        second = s.current
        assert second is not None and second is not first and second.send("hello")
        await wait_for(pilot, lambda: not first.session.busy and not second.session.busy
                       and len(second.session.messages) == 2)
        bad, good = first.session.messages[-1], second.session.messages[-1]
        assert bad.status == "error" and "HTTP 500" in bad.content
        assert "the model crashed" in bad.content
        assert good.status == "done" and good.content == "You said: hello"
        assert openai_stub.requests[-1]["messages"] == [{"role": "user", "content": "hello"}]
        assert status(app).startswith("echo · remote 127.0.0.1")


async def test_remote_server_down(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    app = ChatApp(History(tmp_path / "h.sqlite3"), client=RemoteClient(f"http://127.0.0.1:{port}",
                                                                        model="m"))
    async with app.run_test(size=SIZE) as pilot:
        view = chat(app).current
        assert view is not None and view.send("anyone?")
        await wait_for(pilot, lambda: not view.session.busy and len(view.session.messages) == 2)
        answer = view.session.messages[-1]
        assert answer.status == "error" and "ConnectError" in answer.content
        assert view.prompt.disabled is False  # the tab stays usable


class _SlowVersionHandler(http.server.BaseHTTPRequestHandler):
    """Answers /api/version as localpaged does, after `delay` seconds (a busy server)."""

    delay = 1.0

    def do_GET(self) -> None:
        time.sleep(self.delay)
        body = b'{"version": "0.1.0"}'
        self.send_response(200 if self.path == "/api/version" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_busy_server_is_still_found() -> None:
    """A server slow to answer (loading, or generating on a loaded machine) is attached to,
    not taken for absent; one that takes the connection but never answers is given up on."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowVersionHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        assert chat_launcher.server_running(port)  # answers after 1 s
        start = time.perf_counter()
        assert not chat_launcher.server_running(port, answer_timeout=0.3)
        assert time.perf_counter() - start < 0.9
    finally:
        server.shutdown()
        server.server_close()


def test_launcher_helpers(openai_stub, tmp_path: Path) -> None:
    port = int(openai_stub.url.split(":")[-1].split("/")[0])
    assert chat_launcher.server_running(port)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    assert not chat_launcher.server_running(free)
    args = argparse.Namespace(dtype="float32", device=None, max_model_len=512, kv_cache_gb=None)
    assert chat_launcher.engine_args(args) == {"dtype": "float32", "max_model_len": 512}
    args = build_parser().parse_args(["chat", "--max-step-ms", "0"])  # 0: no step bound
    assert chat_launcher.engine_args(args) == {"dtype": "auto", "max_step_ms": 0.0}
    args = build_parser().parse_args(["chat", "--kv-cache-dtype", "float32"])
    assert chat_launcher.engine_args(args) == {"dtype": "auto", "kv_cache_dtype": "float32"}


def _args(**kw) -> argparse.Namespace:
    base = dict(model=None, remote=None, serve=False, local=False, port=1, dtype="auto",
                device=None, max_model_len=None, kv_cache_gb=None)
    return argparse.Namespace(**{**base, **kw})


def test_launcher_chooses_the_client(openai_stub, tmp_path: Path) -> None:
    history = History(tmp_path / "h.sqlite3")
    port = int(openai_stub.url.split(":")[-1].split("/")[0])
    remote = chat_launcher.build_app(_args(remote=openai_stub.url, model="m"), history)
    assert isinstance(remote.client, RemoteClient) and remote.client.base_url == openai_stub.url
    attached = chat_launcher.build_app(_args(port=port), history)  # a server answers there
    assert isinstance(attached.client, RemoteClient)
    assert attached.client.base_url == f"http://127.0.0.1:{port}/v1"
    local = chat_launcher.build_app(_args(port=port, local=True), history)  # --local
    assert local.client is None and local.loader is not None
    assert local.requested_model == chat_launcher.DEFAULT_MODEL
    served = chat_launcher.build_app(_args(port=port, serve=True, model="x"), history)
    assert served.client is None and served.requested_model == "x"
    history.close()


async def test_serve_shares_the_loaded_engine(tmp_path: Path, tiny_chat_model: Path) -> None:
    """`chat --serve`: once the model is loaded, the localhost API answers from it."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    history = History(tmp_path / "h.sqlite3")
    app = chat_launcher.build_app(_args(model=str(tiny_chat_model), serve=True, port=port,
                                        device="cpu", dtype="float32", max_model_len=256),
                                  history)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.client is not None and app.loading is None)
        async with httpx.AsyncClient() as http:
            resp = await http.get(f"http://127.0.0.1:{port}/v1/models")
        assert resp.status_code == 200
        assert tiny_chat_model.name in resp.text
        assert chat_launcher.server_running(port)
    history.close()


async def test_switching_back_finds_the_previous_model_still_loaded(
        tmp_path: Path, tiny_chat_model: Path) -> None:
    """The app's pool keeps the model it switched away from: switching back loads nothing."""
    import shutil

    other = tmp_path / "other-tiny"
    shutil.copytree(tiny_chat_model, other)
    load = chat_launcher.make_loader({"dtype": "float32", "device": "cpu",
                                      "num_kv_blocks": 64, "max_model_len": 256})
    calls: list[str] = []

    def loader(model: str, progress: Callable[[str], None]):
        calls.append(model)
        return load(model, progress)

    first_name, other_name = str(tiny_chat_model), str(other)
    app = ChatApp(History(tmp_path / "h.sqlite3"), model=first_name, loader=loader,
                  list_models=lambda: [first_name, other_name])
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.client is not None and app.loading is None)
        first = app.client
        app.load_model(other_name)
        await wait_for(pilot, lambda: app.client is not first and app.loading is None)
        assert status(app).startswith(f"{other.name} · cpu")
        app.load_model(first_name)
        await wait_for(pilot, lambda: app.client is first and app.loading is None)
        assert calls == [first_name, other_name]  # no second load of the first
        assert app.models is not None
        assert {m.name for m in app.models.loaded()} == {first_name, other_name}
