"""Settings modal, sidebar of saved chats, export, engine screen, command palette."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from textual.command import CommandList
from textual.pilot import Pilot
from textual.widgets import Input, Sparkline, TextArea

from localpaged.tui.app import ChatApp
from localpaged.tui.engine_screen import EngineScreen, StatsHistory
from localpaged.tui.history import History
from localpaged.tui.main_screen import ChatScreen
from localpaged.tui.session import ChatSettings
from localpaged.tui.settings import SettingsScreen
from localpaged.tui.sidebar import ConversationItem, RenameScreen, Sidebar

SIZE = (110, 32)


def make_app(tmp_path: Path, client, **kw) -> ChatApp:
    history = History(tmp_path / "history.sqlite3")
    return ChatApp(history, client=client, owns_client=False, home=tmp_path,
                   default_settings=ChatSettings(temperature=0, max_tokens=8), **kw)


async def wait_for(pilot: Pilot, cond: Callable[[], bool], timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not reached in time"
        await pilot.pause(0.02)


def palette_top(app: ChatApp) -> str:
    """The highlighted command of the open command palette ("" while there is none)."""
    lists = app.screen.query(CommandList)
    option = lists.first().highlighted_option if lists else None
    return str(option.prompt) if option is not None else ""


def chat(app: ChatApp) -> ChatScreen:
    screen = app._chat_screen()
    assert screen is not None
    return screen


async def test_settings_modal_sets_system_prompt_and_sampling(tmp_path: Path, local_client) -> None:
    app = make_app(tmp_path, local_client)
    async with app.run_test(size=SIZE) as pilot:
        view = chat(app).current
        assert view is not None
        view.send("hi")
        await wait_for(pilot, lambda: not view.session.busy and len(view.session.messages) == 2)
        assert view.session.ids is not None
        await pilot.press("ctrl+o")
        modal = app.screen
        assert isinstance(modal, SettingsScreen)
        modal.query_one("#system", TextArea).load_text("You are terse.")
        modal.query_one("#temperature", Input).value = "hot"
        await pilot.pause()
        await pilot.click("#save")
        assert app.screen is modal  # a bad value keeps the modal open and says why
        assert "Temperature" in str(modal.query_one("#error").content)
        modal.query_one("#temperature", Input).value = "0.5"
        modal.query_one("#top_p", Input).value = "1.5"
        await pilot.press("ctrl+s")
        assert "top_p" in str(modal.query_one("#error").content)
        modal.query_one("#top_p", Input).value = "0.9"
        modal.query_one("#seed", Input).value = "7"
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, ChatScreen)
        s = view.session
        assert s.system_prompt == "You are terse."
        assert (s.settings.temperature, s.settings.top_p, s.settings.seed) == (0.5, 0.9, 7)
        assert s.ids is None  # a new system prompt changes the prompt's start
        conv = app.history.load(s.conv_id)
        assert conv.system_prompt == "You are terse." and conv.settings["seed"] == 7
        # escape cancels without changes
        await pilot.press("ctrl+o")
        app.screen.query_one("#system", TextArea).load_text("changed")
        await pilot.press("escape")
        assert s.system_prompt == "You are terse."
        # the next prompt starts with the system prompt
        view.send("again")
        await wait_for(pilot, lambda: not s.busy and len(s.messages) == 4)
        text = local_client.tokenizer.decode(s._last_prompt_ids, skip_special_tokens=False)
        assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>")


async def test_sidebar_search_rename_delete_reopen(tmp_path: Path, local_client) -> None:
    history = History(tmp_path / "history.sqlite3")
    for title, text in [("Eggs", "how long to boil an egg"), ("Rust", "lifetimes"),
                        ("Tea", "green or black")]:
        cid = history.create(title)
        history.add_message(cid, "user", text)
        history.add_message(cid, "assistant", f"about {title.lower()}")
    history.close()
    app = make_app(tmp_path, local_client)
    async with app.run_test(size=SIZE) as pilot:
        s = chat(app)
        await pilot.press("ctrl+b")
        sidebar = s.query_one(Sidebar)
        assert sidebar.has_class("shown")

        def titles() -> list[str]:
            return [str(item.query_one("Label").content)
                    for item in sidebar.query(ConversationItem)]

        await pilot.pause()
        assert titles()[:3] == ["Tea", "Rust", "Eggs"] or set(titles()) >= {"Tea", "Rust", "Eggs"}
        sidebar.query_one("#search", Input).value = "egg"
        await pilot.pause()
        assert titles() == ["Eggs"]
        sidebar.query_one("#search", Input).value = ""
        await pilot.pause()
        sidebar.query_one("#conversations").focus()
        # highlight "Rust" and rename it
        lv = sidebar.query_one("#conversations")
        lv.index = titles().index("Rust")
        await pilot.press("r")
        assert isinstance(app.screen, RenameScreen)
        app.screen.query_one(Input).value = "Rust lifetimes"
        await pilot.press("enter")
        await pilot.pause()
        assert "Rust lifetimes" in titles()
        # delete "Tea"
        lv.index = titles().index("Tea")
        await pilot.press("d")
        await pilot.pause()
        assert "Tea" not in titles()
        assert [c.title for c in app.history.list("Tea")] == []
        # reopen "Eggs" into a tab
        lv.index = titles().index("Eggs")
        await pilot.press("enter")
        await wait_for(pilot, lambda: s.current is not None and s.current.session.title == "Eggs")
        assert [m.content for m in s.current.session.messages] == [
            "how long to boil an egg", "about eggs"]
        assert s.current.session.ids is None  # made by another model: rebuilt from the template
        n_tabs = len(s.views)
        await pilot.press("enter")  # reopening an open conversation focuses its tab
        assert len(s.views) == n_tabs


async def test_export_to_markdown_from_the_palette(tmp_path: Path, local_client) -> None:
    app = make_app(tmp_path, local_client)
    async with app.run_test(size=SIZE) as pilot:
        view = chat(app).current
        assert view is not None
        view.send("Export me")
        await wait_for(pilot, lambda: not view.session.busy and len(view.session.messages) == 2)
        await pilot.press("ctrl+p")
        await pilot.press(*"Export to Markdown")
        await wait_for(pilot, lambda: palette_top(app).startswith("Export to Markdown")
                       and "Export to Markdown" in palette_top(app))
        await pilot.press("enter")
        path = tmp_path / "exports" / f"export-me-{view.session.conv_id}.md"
        await wait_for(pilot, path.exists)
        text = path.read_text()
        assert text.startswith("# Export me\n") and "## You\n\nExport me" in text
        assert "## Assistant" in text


async def test_engine_screen_shows_counters_and_sparklines(tmp_path: Path, local_client) -> None:
    app = make_app(tmp_path, local_client)
    async with app.run_test(size=SIZE) as pilot:
        view = chat(app).current
        assert view is not None
        view.send("engine")
        await wait_for(pilot, lambda: not view.session.busy and len(view.session.messages) == 2)
        await pilot.press("ctrl+g")
        assert isinstance(app.screen, EngineScreen)
        await pilot.pause(0.6)
        counters = str(app.screen.query_one("#counters").content)
        stats = local_client.stats()
        assert f"KV blocks          {stats.kv_blocks_used} / {stats.kv_blocks_total}" in counters
        assert f"generated tokens   {stats.generation_tokens_total}" in counters
        itl = stats.inter_token_latency
        assert itl.count >= 1
        assert (f"inter-token gap    p50 {itl.p50 * 1e3:.1f} ms, p99 {itl.p99 * 1e3:.1f} ms"
                in counters)
        assert f"step bound         {stats.step_bound}" in counters
        assert len(app.screen.query(Sparkline)) == 2
        await pilot.press("escape")
        assert isinstance(app.screen, ChatScreen)


def test_stats_history_rates() -> None:
    from localpaged.engine.client import EngineStats

    h = StatsHistory(size=4)
    h.add(EngineStats("m", "cpu", generation_tokens_total=0, kv_blocks_total=10), 0.0)
    h.add(EngineStats("m", "cpu", generation_tokens_total=50, kv_blocks_used=5,
                      kv_blocks_total=10), 0.5)
    assert list(h.throughput) == [0, 0, 0, 100.0]
    assert list(h.kv_use) == [0, 0, 0, 50.0]
