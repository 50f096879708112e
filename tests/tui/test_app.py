"""The chat app on the real engine (tiny random Llama with SmolLM2's tokenizer), driven by Pilot."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from textual import events
from textual.pilot import Pilot

from localpaged.tui.app import ChatApp
from localpaged.tui.chat_view import ChatView, MessageView
from localpaged.tui.history import History
from localpaged.tui.main_screen import BUSY, ChatScreen
from localpaged.tui.session import ChatSettings

SIZE = (110, 32)


def make_app(tmp_path: Path, client, max_tokens: int = 24, **kw) -> ChatApp:
    history = History(tmp_path / "history.sqlite3")
    settings = ChatSettings(temperature=0, max_tokens=max_tokens)
    return ChatApp(history, client=client, owns_client=False, default_settings=settings,
                   home=tmp_path, **kw)


async def wait_for(pilot: Pilot, cond: Callable[[], bool], timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not reached in time"
        await pilot.pause(0.02)


async def keys(pilot: Pilot, *names: str) -> None:
    """Press keys without Pilot's wait for an idle app (which never comes while tabs stream):
    the same key events, through the same driver queue."""
    for name in names:
        char = name if len(name) == 1 else None
        pilot.app._driver.send_message(events.Key(name, char))
    await pilot.pause(0.05)


def screen(app: ChatApp) -> ChatScreen:
    assert isinstance(app.screen, ChatScreen)
    return app.screen


def answered(view: ChatView, n: int = 1) -> Callable[[], bool]:
    """True once the view has n finished answers."""
    return lambda: not view.session.busy and sum(
        m.role == "assistant" for m in view.session.messages) >= n


async def test_three_tabs_stream_concurrently(tmp_path: Path, local_client) -> None:
    app = make_app(tmp_path, local_client, max_tokens=320)
    async with app.run_test(size=SIZE) as pilot:
        for n, text in enumerate("abc", 1):
            if n > 1:
                await keys(pilot, "ctrl+t")
                await wait_for(pilot, lambda n=n: len(screen(app).views) == n
                               and app.focused is screen(app).views[-1].prompt)
            await keys(pilot, text, "enter")
        views = screen(app).views
        assert len(views) == 3
        most_busy = most_running = 0
        labels_seen: set[str] = set()
        while any(v.session.busy for v in views) or most_busy == 0:
            most_busy = max(most_busy, sum(v.session.busy for v in views))
            most_running = max(most_running, local_client.stats().num_running)
            labels_seen |= {str(screen(app).tabs.get_tab(f"conv-{v.session.conv_id}").label)
                            for v in views[:2]}
            await pilot.pause(0.02)
        assert (most_busy, most_running) == (3, 3)  # all three streamed at the same time
        assert any(label.startswith(BUSY) for label in labels_seen)  # background tab marker
        for v in views:
            answer = v.session.messages[-1]
            assert answer.role == "assistant" and answer.status == "done"
            assert v.session.stats.output_tokens == 320
        await wait_for(pilot, lambda: not any(
            str(screen(app).tabs.get_tab(f"conv-{v.session.conv_id}").label).startswith(BUSY)
            for v in views))


async def test_stop_mid_answer_keeps_the_partial_answer(tmp_path: Path, local_client) -> None:
    app = make_app(tmp_path, local_client, max_tokens=900)
    async with app.run_test(size=SIZE) as pilot:
        await keys(pilot, "s", "t", "o", "p", "enter")
        view = screen(app).current
        assert view is not None
        await wait_for(pilot, lambda: view.session.stats.output_tokens >= 8)
        live = view.query(MessageView).last()
        assert str(live.query_one(".incomplete").content) == ""  # being written, not broken
        await keys(pilot, "escape")
        await wait_for(pilot, lambda: not view.session.busy)
        answer = view.session.messages[-1]
        assert answer.status == "stopped"
        assert 8 <= view.session.stats.output_tokens < 900
        assert "stopped" in str(view.query(MessageView).last().query_one(".incomplete").content)
        assert app.history.load(view.session.conv_id).messages[-1].status == "stopped"
        await wait_for(pilot, lambda: local_client.stats().num_running == 0)


async def test_regenerate_answers_the_same_prompt_again(tmp_path: Path, local_client) -> None:
    app = make_app(tmp_path, local_client)
    async with app.run_test(size=SIZE) as pilot:
        view = screen(app).current
        assert view is not None and view.send("regenerate me")
        await wait_for(pilot, answered(view))
        first = view.session.messages[-1]
        prompt_tokens = view.session.stats.prompt_tokens
        await keys(pilot, "ctrl+r")
        await wait_for(pilot, lambda: view.session.messages[-1] is not first
                       and answered(view)())
        roles = [m.role for m in view.session.messages]
        assert roles == ["user", "assistant"] and len(view.query(MessageView)) == 2
        again = view.session.messages[-1]
        assert again.status == "done" and again.content == first.content  # greedy
        # the same prompt, so its full blocks come from the prefix cache
        assert view.session.stats.prompt_tokens == prompt_tokens
        assert view.session.stats.cached_tokens == (prompt_tokens - 1) // 16 * 16
        stored = app.history.load(view.session.conv_id).messages
        assert [m.id for m in stored] == [m.id for m in view.session.messages]


async def test_tab_keys(tmp_path: Path, local_client) -> None:
    app = make_app(tmp_path, local_client)
    async with app.run_test(size=SIZE) as pilot:
        s = screen(app)

        def active() -> int:
            return s.views.index(s.current) + 1

        await pilot.press("ctrl+t", "ctrl+t")
        assert len(s.views) == 3 and active() == 3
        await pilot.press("ctrl+pageup")
        assert active() == 2
        await pilot.press("ctrl+pagedown", "ctrl+pagedown")
        assert active() == 1  # wraps around
        await pilot.press("alt+3")
        assert active() == 3
        await pilot.press("alt+9")  # no ninth tab: nothing happens
        assert active() == 3
        await pilot.press("alt+2", "ctrl+w")
        assert len(s.views) == 2
        assert [str(s.tabs.get_tab(f"conv-{v.session.conv_id}").label) for v in s.views] == [
            "1: New chat", "2: New chat"]
        assert app.focused is s.current.prompt
        await pilot.press("ctrl+w", "ctrl+w")  # closing the last tab opens a new one
        assert len(s.views) == 1
        assert app.history.open_tabs() == [s.views[0].session.conv_id]


async def test_history_survives_a_restart(tmp_path: Path, local_client) -> None:
    app = make_app(tmp_path, local_client)
    async with app.run_test(size=SIZE) as pilot:
        s = screen(app)
        assert s.current is not None and s.current.send("first chat")
        await pilot.press("ctrl+t")
        assert s.current.send("second chat")
        await wait_for(pilot, lambda: all(answered(v)() for v in s.views))
        before = [(v.session.conv_id, v.session.title,
                   [(m.role, m.content) for m in v.session.messages], v.session.ids)
                  for v in s.views]
    app.history.close()

    app2 = make_app(tmp_path, local_client)
    async with app2.run_test(size=SIZE) as pilot:
        s = screen(app2)
        after = [(v.session.conv_id, v.session.title,
                  [(m.role, m.content) for m in v.session.messages], v.session.ids)
                 for v in s.views]
        assert after == before  # same tabs, same order, same messages, same exact ids
        assert len(s.views[1].query(MessageView)) == 2
        # the exact ids survived, so a follow-up reuses the cached K/V of turn 1 (all but the
        # last sampled token's: it was never fed back)
        view = s.views[1]
        ids1 = view.session.ids
        assert ids1 is not None and view.send("and more")
        await wait_for(pilot, answered(view, 2))
        assert view.session.stats.cached_tokens == len(ids1) - 1
    app2.history.close()


async def test_turn_two_reuses_turn_one(tmp_path: Path, local_client) -> None:
    """Exact turns: turn 2's prompt starts with turn 1's prompt and answer ids, and the engine
    finds their K/V in the prefix cache (the full blocks, then the part-filled last one);
    the status line says so."""
    app = make_app(tmp_path, local_client, max_tokens=40)
    async with app.run_test(size=SIZE) as pilot:
        view = screen(app).current
        assert view is not None
        view.send("Tell me about paged attention.")
        await wait_for(pilot, answered(view))
        turn1 = list(view.session.ids or [])
        assert len(turn1) == view.session.stats.prompt_tokens + 40
        hits_before = local_client.stats().prefix_cache_hits
        view.send("And prefix caching?")
        await wait_for(pilot, answered(view, 2))
        prompt2 = view.session._last_prompt_ids
        assert prompt2 is not None and prompt2[: len(turn1)] == turn1
        # every token of turn 1 has its K/V computed except the last sampled one; all of them
        # are reused
        reused = len(turn1) - 1
        st = view.session.stats
        assert st.cached_tokens == reused and st.prompt_tokens == len(prompt2)
        assert local_client.stats().prefix_cache_hits - hits_before == reused
        screen(app).refresh_status()
        status = str(screen(app).query_one("#status").content)
        assert f"reused {reused}/{len(prompt2)} tok" in status
        assert "KV " in status and "prefix hits" in status and "TTFT" in status
        assert "tok/s" in status and "queued 0" in status


async def test_empty_message_is_not_sent(tmp_path: Path, local_client) -> None:
    app = make_app(tmp_path, local_client)
    async with app.run_test(size=SIZE) as pilot:
        view = screen(app).current
        assert view is not None
        await pilot.press("enter", "space", "space", "enter")
        assert view.session.messages == [] and not view.session.busy
        assert app.history.load(view.session.conv_id).messages == []


async def test_multiline_input_edit_and_resend(tmp_path: Path, local_client) -> None:
    app = make_app(tmp_path, local_client)
    async with app.run_test(size=SIZE) as pilot:
        view = screen(app).current
        assert view is not None
        await pilot.press("o", "n", "e", "ctrl+j", "t", "w", "o", "enter")
        assert view.session.messages[0].content == "one\ntwo"
        await wait_for(pilot, answered(view))
        await pilot.press("ctrl+e")
        assert view.session.messages == [] and view.prompt.text == "one\ntwo"
        assert len(view.query(MessageView)) == 0
        await pilot.press("!", "enter")
        await wait_for(pilot, answered(view))
        assert view.session.messages[0].content == "one\ntwo!"
        assert app.history.load(view.session.conv_id).messages[0].content == "one\ntwo!"


async def test_copy_and_clear(tmp_path: Path, local_client) -> None:
    app = make_app(tmp_path, local_client)
    async with app.run_test(size=SIZE) as pilot:
        view = screen(app).current
        assert view is not None
        view.send("copy")
        await wait_for(pilot, answered(view))
        view.session.messages[-1].content = "Run this:\n```sh\necho hi\n```\n"
        await pilot.press("ctrl+y")
        assert app.clipboard == view.session.messages[-1].content
        await pilot.press("ctrl+k")
        assert app.clipboard == "echo hi"
        await pilot.press("ctrl+l")
        assert view.session.messages == [] and len(view.query(MessageView)) == 0
        assert app.history.load(view.session.conv_id).messages == []


async def test_prompt_longer_than_the_context(tmp_path: Path, local_client) -> None:
    app = make_app(tmp_path, local_client, max_tokens=8)
    async with app.run_test(size=SIZE) as pilot:
        view = screen(app).current
        assert view is not None
        view.send("alpha " * 600)
        await wait_for(pilot, answered(view))
        view.send("beta " * 600)
        notice = view.query_one("#notice-text")
        await wait_for(pilot, lambda: "context holds 1024" in str(notice.content))
        assert "The prompt is " in str(notice.content)
        assert view.session.messages[-1].role == "user"  # nothing sent
        await pilot.click("#drop-oldest")
        await wait_for(pilot, lambda: answered(view)() and
                       view.session.messages[-1].role == "assistant")
        assert [m.role for m in view.session.messages] == ["user", "assistant"]
        assert view.session.messages[0].content.startswith("beta")
        assert len(app.history.load(view.session.conv_id).messages) == 2


async def test_a_single_message_longer_than_the_context(tmp_path: Path, local_client) -> None:
    app = make_app(tmp_path, local_client)
    async with app.run_test(size=SIZE) as pilot:
        view = screen(app).current
        assert view is not None
        view.send("gamma " * 1100)
        notice = view.query_one("#notice-text")
        await wait_for(pilot, lambda: "Shorten the message" in str(notice.content))
        assert "context holds 1024" in str(notice.content)
        assert not view.query_one("#drop-oldest").display or not view.query_one(
            "Notice").has_class("offer")
        await pilot.press("ctrl+e")
        assert view.prompt.text.startswith("gamma") and view.session.messages == []
