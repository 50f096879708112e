"""SIGKILL the app while it streams: the partial answer is saved, marked incomplete, and the
database is intact."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from localpaged.tui.app import ChatApp
from localpaged.tui.chat_view import MessageView
from localpaged.tui.history import History
from localpaged.tui.main_screen import ChatScreen

# The app as `localpaged chat MODEL --local` builds it, run headless, sending one message as
# soon as the model is loaded.
APP = """
import sys
from localpaged import chat_launcher
from localpaged.tui.app import ChatApp
from localpaged.tui.history import History
from localpaged.tui.session import ChatSettings

class Kicked(ChatApp):
    def on_ready(self) -> None:
        self.set_interval(0.1, self.kick)

    def kick(self) -> None:
        view = self._chat_screen().current
        if self.client is not None and view is not None and not view.session.messages:
            view.send("Tell me a very long story.")

loader = chat_launcher.make_loader({"dtype": "float32", "device": "cpu", "num_kv_blocks": 128,
                                    "max_model_len": 2048})
Kicked(History(sys.argv[1]), model=sys.argv[2], loader=loader,
       default_settings=ChatSettings(temperature=1.0, seed=0, max_tokens=1900)).run(headless=True)
"""


def streaming_answer(db: Path) -> tuple[str, str] | None:
    """(content, status) of the answer being streamed, once it has some text saved."""
    if not db.exists():
        return None
    con = sqlite3.connect(db, timeout=5)
    try:
        row = con.execute("SELECT content, status FROM messages WHERE role = 'assistant'"
                          " ORDER BY id DESC LIMIT 1").fetchone()
    except sqlite3.OperationalError:
        return None
    finally:
        con.close()
    return (row[0], row[1]) if row and row[0] else None


async def test_sigkill_during_an_answer(tmp_path: Path, tiny_chat_model: Path) -> None:
    db = tmp_path / "history.sqlite3"
    proc = subprocess.Popen([sys.executable, "-c", APP, str(db), str(tiny_chat_model)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        seen = None
        while seen is None or len(seen[0]) < 20:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "the app never streamed"
            time.sleep(0.1)
            seen = streaming_answer(db)
        assert seen[1] == "streaming"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL

    history = History(db)
    assert history.integrity_check() == "ok"
    [conv_id] = history.open_tabs()
    conv = history.load(conv_id)
    assert [m.role for m in conv.messages] == ["user", "assistant"]
    partial = conv.messages[-1]
    assert partial.incomplete and len(partial.content) >= len(seen[0])

    # a restarted app shows the conversation with the partial answer marked incomplete
    app = ChatApp(history, model="")
    async with app.run_test(size=(100, 30)):
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        [view] = screen.views
        assert view.session.conv_id == conv_id
        note = view.query(MessageView).last().query_one(".incomplete")
        assert "incomplete" in str(note.content)
    history.close()
