"""SVG snapshots (pytest-textual-snapshot) of the main screen, the settings modal and the
engine screen. Deterministic: fixed terminal size, a conversation loaded from history, a fresh
engine that has generated nothing (no timings on screen), no cursor blink."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot
from textual.widgets import Input, TextArea

from localpaged.tui.app import ChatApp
from localpaged.tui.history import History
from localpaged.tui.settings import SettingsScreen

SIZE = (110, 32)

ANSWER = """Paged attention stores the KV cache in fixed-size **blocks**, like pages of virtual
memory, so many chats share one pool without fragmentation.

```python
block_table = [7, 3, 12]  # logical block i -> physical block
slot = block_table[pos // 16] * 16 + pos % 16
```

A new turn reuses the blocks of the previous one through the *prefix cache*."""


@pytest.fixture(scope="module")
def fresh_client(tiny_chat_model: Path) -> Iterator[Any]:
    """An engine of its own, so no other test's counters show in the snapshots."""
    from localpaged.engine.async_engine import LocalClient

    client = LocalClient.from_model(str(tiny_chat_model), dtype="float32", device="cpu",
                                    num_kv_blocks=512, max_model_len=1024)
    yield client
    client.async_engine.close()


def app_with_history(tmp_path: Path, client: Any) -> ChatApp:
    history = History(tmp_path / "history.sqlite3")
    a = history.create("Paged attention", model=client.model_name)
    history.add_message(a, "user", "What is paged attention? Show me the block table.")
    history.add_message(a, "assistant", ANSWER)
    history.add_message(a, "user", "And how do chats share blocks?")
    history.add_message(a, "assistant", "Each chat keeps the exact token ids of its turns", "streaming")
    b = history.create("Rust lifetimes", model=client.model_name)
    history.add_message(b, "user", "Explain 'a in one line.")
    history.set_open_tabs([a, b])
    return ChatApp(history, client=client, owns_client=False)


async def until(pilot: Pilot, ready: Callable[[], bool], failure: Callable[[], str]) -> None:
    """Pause until `ready()`, bounded: a state that never arrives fails (`failure()` says
    what was there instead), not hangs."""
    for _ in range(200):
        if ready():
            return
        await pilot.pause(0.05)
    raise AssertionError(failure())


async def no_blink(pilot: Pilot) -> None:
    await pilot.pause()
    for w in pilot.app.screen.query("TextArea, Input"):
        assert isinstance(w, (TextArea, Input))
        w.cursor_blink = False


def test_main_screen(snap_compare, tmp_path: Path, fresh_client) -> None:
    assert snap_compare(app_with_history(tmp_path, fresh_client), terminal_size=SIZE,
                        run_before=no_blink)


def test_settings_modal(snap_compare, tmp_path: Path, fresh_client) -> None:
    async def open_settings(pilot: Pilot) -> None:
        await no_blink(pilot)
        await pilot.press("ctrl+o")
        # The modal's own fields stop blinking only once it is up and focused: on a loaded
        # machine one pause after the key could come before, leaving a cursor caught mid-blink.
        await until(pilot, lambda: isinstance(pilot.app.screen, SettingsScreen)
                    and pilot.app.screen.focused is not None,
                    lambda: f"ctrl+o left {pilot.app.screen!r} on top")
        await no_blink(pilot)

    assert snap_compare(app_with_history(tmp_path, fresh_client), terminal_size=SIZE,
                        run_before=open_settings)


def test_engine_screen(snap_compare, tmp_path: Path, fresh_client) -> None:
    async def open_engine(pilot: Pilot) -> None:
        await no_blink(pilot)
        await pilot.press("ctrl+g")
        await pilot.pause(0.1)

    assert snap_compare(app_with_history(tmp_path, fresh_client), terminal_size=SIZE,
                        run_before=open_engine)


def test_sidebar(snap_compare, tmp_path: Path, fresh_client) -> None:
    async def open_sidebar(pilot: Pilot) -> None:
        await no_blink(pilot)
        await pilot.pause(0.3)  # the tabs restored from history settle (and take focus) first
        await pilot.press("ctrl+b")
        await until(pilot, lambda: pilot.app.focused is not None
                    and pilot.app.focused.id == "conversations",
                    lambda: f"ctrl+b left the focus on {pilot.app.focused!r}")
        await no_blink(pilot)

    assert snap_compare(app_with_history(tmp_path, fresh_client), terminal_size=SIZE,
                        run_before=open_sidebar)


THOUGHT = "<think>\nThe user asks why the sky is blue. Rayleigh scattering: short waves.\n</think>\n\n"


def test_thinking_folded(snap_compare, tmp_path: Path, fresh_client) -> None:
    """A saved answer of a thinking model: its thinking folded under a toggle, the answer
    apart; a second answer with its thinking opened."""
    history = History(tmp_path / "history.sqlite3")
    c = history.create("Blue sky", model=fresh_client.model_name)
    history.add_message(c, "user", "Why is the sky blue?")
    history.add_message(c, "assistant", THOUGHT + "Air scatters **blue** light the most.")
    history.add_message(c, "user", "And sunsets?")
    history.add_message(c, "assistant", "<think>\nLong path, blue scattered away.\n</think>\n\n"
                                        "The light crosses more air, so red is left.")
    history.set_open_tabs([c])

    async def open_second(pilot: Pilot) -> None:
        await no_blink(pilot)
        titles = list(pilot.app.screen.query("CollapsibleTitle"))
        await pilot.click(titles[-1])
        await no_blink(pilot)

    assert snap_compare(ChatApp(history, client=fresh_client, owns_client=False),
                        terminal_size=SIZE, run_before=open_second)


def test_tool_calls_shown(snap_compare, tmp_path: Path, fresh_client) -> None:
    """A saved chat with tool calls (written by the API's clients): each call compact with its
    function and arguments, each result under it, then the final answer."""
    from tests.tui.test_tools import tool_chat

    history = History(tmp_path / "history.sqlite3")
    tool_chat(history, fresh_client.model_name)
    assert snap_compare(ChatApp(history, client=fresh_client, owns_client=False),
                        terminal_size=SIZE, run_before=no_blink)
