"""Tool calls in saved chats: a chat the API's clients wrote (an assistant message of tool
calls, `tool` results, a final answer) shows each call (function and arguments) and each
result as such, not as raw text; the history database gains the tool columns when an older
one is opened, its rows kept."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from textual.widgets import Markdown

from localpaged.tui.chat_view import MessageView, ToolCallView, ToolResultView
from localpaged.tui.history import History
from tests.tui.test_app import SIZE, screen

ARGS = {"city": "Paris", "unit": "celsius", "days": 2}
CALLS = [{"id": "call_w1", "type": "function",  # as the openai client gives them back
          "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}},
         {"id": "call_t1", "type": "function",
          "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]


def tool_chat(history: History, model: str) -> int:
    """A saved chat with two tool calls, their results (the second answered first, by id)
    and a final answer."""
    c = history.create("Weather in Paris", model=model)
    history.add_message(c, "user", "What is the weather in Paris, and the time?")
    history.add_message(c, "assistant", "", tool_calls=CALLS)
    history.add_message(c, "tool", "14:05", tool_call_id="call_t1")
    history.add_message(c, "tool", "18 C and sunny", tool_call_id="call_w1")
    history.add_message(c, "assistant", "It is **18 C and sunny** in Paris, at 14:05.")
    history.set_open_tabs([c])
    return c


async def test_saved_tool_calls_and_results_are_shown(tmp_path: Path, local_client: Any) -> None:
    from localpaged.tui.app import ChatApp

    history = History(tmp_path / "history.sqlite3")
    conv = tool_chat(history, local_client.model_name)
    app = ChatApp(history, client=local_client, owns_client=False, home=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        view = screen(app).current
        assert view is not None
        calls = [str(w.content) for w in view.query(ToolCallView)]
        assert calls == ['⚙ get_weather(city="Paris", unit="celsius", days=2)',
                         '⚙ get_time(zone="CET")']
        results = [str(w.content) for w in view.query(ToolResultView)]
        assert results == ["↳ get_time returned: 14:05",
                           "↳ get_weather returned: 18 C and sunny"]
        messages = list(view.query(MessageView))
        assert [m.message.role for m in messages] == ["user", "assistant", "tool", "tool",
                                                      "assistant"]
        # the calls' answer has no text body; nothing shows the raw call JSON
        assert not messages[1].query_one(Markdown).display
        sources = [md.source for md in view.query(Markdown)]
        assert not any("arguments" in s or "call_w1" in s for s in sources)
        assert all(w.region.height > 0 for w in [*view.query(ToolCallView),
                                                 *view.query(ToolResultView)])
        # shown, not sent: the app gives the model no tools
        assert [m["role"] for m in view.session.chat_messages()] == ["user", "assistant"]
    md = history.export_markdown(conv)
    assert 'Tool call: `get_weather(city="Paris", unit="celsius", days=2)`' in md
    assert "## Tool result\n\n18 C and sunny" in md


OLD_SCHEMA = """
CREATE TABLE conversations (
    id INTEGER PRIMARY KEY, title TEXT NOT NULL, model TEXT NOT NULL DEFAULT '',
    system_prompt TEXT NOT NULL DEFAULT '', settings TEXT NOT NULL DEFAULT '{}', token_ids TEXT,
    created REAL NOT NULL, updated REAL NOT NULL, open_position INTEGER);
CREATE TABLE messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL, content TEXT NOT NULL, status TEXT NOT NULL DEFAULT 'done',
    created REAL NOT NULL);
INSERT INTO conversations (id, title, created, updated) VALUES (1, 'Old chat', 0, 0);
INSERT INTO messages (conversation_id, role, content, created) VALUES (1, 'user', 'hi', 0);
"""


def test_an_older_database_gains_the_tool_columns(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(OLD_SCHEMA)
    db.close()
    history = History(path)
    [old] = history.load(1).messages
    assert (old.content, old.tool_calls, old.tool_call_id) == ("hi", None, None)
    history.add_message(1, "assistant", "", tool_calls=CALLS[:1])
    history.add_message(1, "tool", "18 C", tool_call_id="call_w1")
    history.close()
    again = History(path)  # a second open finds the columns there
    msgs = again.load(1).messages
    assert msgs[1].tool_calls == CALLS[:1] and msgs[2].tool_call_id == "call_w1"
    assert again.integrity_check() == "ok"
