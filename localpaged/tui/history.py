"""Chat history in SQLite (stdlib `sqlite3`, WAL): conversations, their messages, open tabs.

An assistant message may hold tool calls (`tool_calls`: a JSON list of OpenAI-shaped calls,
`{"id", "type": "function", "function": {"name", "arguments"}}`), a `tool` message a call's
result (`tool_call_id` names the call). A database from before these columns gains them when
opened.

Every write commits at once, so a killed app loses at most the text streamed since the last
save. A streaming answer is a message with status "streaming"; it becomes "done", "stopped"
or "error" when it ends. A message still "streaming" when the app starts is one the app died
during: the UI shows it as incomplete.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    model TEXT NOT NULL DEFAULT '',
    system_prompt TEXT NOT NULL DEFAULT '',
    settings TEXT NOT NULL DEFAULT '{}',
    token_ids TEXT,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    open_position INTEGER
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'done',
    created REAL NOT NULL,
    tool_calls TEXT,
    tool_call_id TEXT
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""

# columns added since the first schema: (name, type), added to older databases on open
ADDED_COLUMNS = {"messages": [("tool_calls", "TEXT"), ("tool_call_id", "TEXT")]}

INCOMPLETE = "streaming"


def data_dir() -> Path:
    """`$LOCALPAGED_HOME`, else the platform's user data dir for localpaged."""
    home = os.environ.get("LOCALPAGED_HOME")
    if home:
        return Path(home).expanduser()
    from platformdirs import user_data_dir

    return Path(user_data_dir("localpaged"))


@dataclass
class StoredMessage:
    """One saved message; `status` is done, stopped, error or streaming (incomplete)."""

    id: int
    role: str
    content: str
    status: str = "done"
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool result's call

    @property
    def incomplete(self) -> bool:
        return self.status == INCOMPLETE


@dataclass
class Conversation:
    """A saved conversation (messages loaded by `History.load`)."""

    id: int
    title: str
    model: str = ""
    system_prompt: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    token_ids: list[int] | None = None
    updated: float = 0.0
    messages: list[StoredMessage] = field(default_factory=list)


class History:
    """The chat database. One connection, used from the app's event loop thread."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)
        self._migrate()

    def _migrate(self) -> None:
        """Add the columns an older database lacks (its rows get NULL there)."""
        for table, columns in ADDED_COLUMNS.items():
            have = {r["name"] for r in self.db.execute(f"PRAGMA table_info({table})")}
            for name, kind in columns:
                if name not in have:
                    self.db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")

    @classmethod
    def in_data_dir(cls, root: Path | None = None) -> History:
        """The history database `history.sqlite3` in the data dir."""
        return cls((root or data_dir()) / "history.sqlite3")

    def close(self) -> None:
        self.db.close()

    # conversations
    def create(self, title: str = "New chat", *, model: str = "", system_prompt: str = "",
               settings: dict[str, Any] | None = None) -> int:
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO conversations (title, model, system_prompt, settings, created, updated)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (title, model, system_prompt, json.dumps(settings or {}), now, now))
        return int(cur.lastrowid or 0)

    def update_conversation(self, conv_id: int, **fields: Any) -> None:
        """Set any of title, model, system_prompt, settings (dict), token_ids (list or None)."""
        allowed = {"title", "model", "system_prompt", "settings", "token_ids"}
        unknown = set(fields) - allowed
        if unknown:
            raise ValueError(f"unknown conversation fields: {sorted(unknown)}")
        if "settings" in fields:
            fields["settings"] = json.dumps(fields["settings"])
        if "token_ids" in fields and fields["token_ids"] is not None:
            fields["token_ids"] = json.dumps(fields["token_ids"])
        sets = ", ".join(f"{k} = ?" for k in fields)
        self.db.execute(f"UPDATE conversations SET {sets}, updated = ? WHERE id = ?",
                        (*fields.values(), time.time(), conv_id))

    def rename(self, conv_id: int, title: str) -> None:
        self.update_conversation(conv_id, title=title.strip() or "Untitled")

    def delete(self, conv_id: int) -> None:
        self.db.execute("DELETE FROM conversations WHERE id = ?", (conv_id,))

    def list(self, search: str = "") -> list[Conversation]:
        """Saved conversations, most recently updated first; `search` matches title or text."""
        if search:
            like = f"%{search}%"
            rows = self.db.execute(
                "SELECT * FROM conversations c WHERE c.title LIKE ? OR EXISTS (SELECT 1 FROM"
                " messages m WHERE m.conversation_id = c.id AND m.content LIKE ?)"
                " ORDER BY updated DESC, id DESC", (like, like)).fetchall()
        else:
            rows = self.db.execute(
                "SELECT * FROM conversations ORDER BY updated DESC, id DESC").fetchall()
        return [_conversation(r) for r in rows]

    def load(self, conv_id: int) -> Conversation:
        row = self.db.execute("SELECT * FROM conversations WHERE id = ?", (conv_id,)).fetchone()
        if row is None:
            raise KeyError(conv_id)
        conv = _conversation(row)
        conv.messages = [
            StoredMessage(r["id"], r["role"], r["content"], r["status"],
                          json.loads(r["tool_calls"]) if r["tool_calls"] else None,
                          r["tool_call_id"])
            for r in self.db.execute(
                "SELECT id, role, content, status, tool_calls, tool_call_id FROM messages"
                " WHERE conversation_id = ? ORDER BY id", (conv_id,))
        ]
        return conv

    # messages
    def add_message(self, conv_id: int, role: str, content: str, status: str = "done", *,
                    tool_calls: list[dict[str, Any]] | None = None,
                    tool_call_id: str | None = None) -> int:
        """A new message; `tool_calls` an assistant's calls, `tool_call_id` the call a `tool`
        message answers."""
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO messages (conversation_id, role, content, status, created, tool_calls,"
            " tool_call_id) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (conv_id, role, content, status, now,
             json.dumps(tool_calls) if tool_calls else None, tool_call_id))
        self.db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conv_id))
        return int(cur.lastrowid or 0)

    def update_message(self, msg_id: int, content: str, status: str | None = None) -> None:
        if status is None:
            self.db.execute("UPDATE messages SET content = ? WHERE id = ?", (content, msg_id))
        else:
            self.db.execute("UPDATE messages SET content = ?, status = ? WHERE id = ?",
                            (content, status, msg_id))

    def delete_messages(self, msg_ids: list[int]) -> None:
        self.db.executemany("DELETE FROM messages WHERE id = ?", [(i,) for i in msg_ids])

    def clear(self, conv_id: int) -> None:
        self.db.execute("DELETE FROM messages WHERE conversation_id = ?", (conv_id,))
        self.update_conversation(conv_id, token_ids=None)

    # open tabs
    def set_open_tabs(self, conv_ids: list[int]) -> None:
        """Remember which conversations are open as tabs, in order."""
        self.db.execute("BEGIN")
        self.db.execute("UPDATE conversations SET open_position = NULL")
        self.db.executemany("UPDATE conversations SET open_position = ? WHERE id = ?",
                            list(enumerate(conv_ids)))
        self.db.execute("COMMIT")

    def open_tabs(self) -> list[int]:
        rows = self.db.execute("SELECT id FROM conversations WHERE open_position IS NOT NULL"
                               " ORDER BY open_position").fetchall()
        return [r["id"] for r in rows]

    def integrity_check(self) -> str:
        return str(self.db.execute("PRAGMA integrity_check").fetchone()[0])

    def export_markdown(self, conv_id: int) -> str:
        """The conversation as a Markdown document."""
        conv = self.load(conv_id)
        out = [f"# {conv.title}", ""]
        if conv.model:
            out += [f"*Model: {conv.model}*", ""]
        if conv.system_prompt:
            out += ["## System", "", conv.system_prompt, ""]
        for m in conv.messages:
            head = {"user": "You", "assistant": "Assistant",
                    "tool": "Tool result"}.get(m.role, m.role.title())
            if m.incomplete:
                head += " (incomplete)"
            elif m.status in ("stopped", "error"):
                head += f" ({m.status})"
            out += [f"## {head}", ""]
            if m.content:
                out += [m.content, ""]
            out += [f"Tool call: `{call_text(c)}`" for c in m.tool_calls or []]
            if m.tool_calls:
                out.append("")
        return "\n".join(out).rstrip() + "\n"


def call_parts(call: dict[str, Any]) -> tuple[str, dict[str, Any] | str]:
    """(function name, arguments) of a saved call (the arguments an object where they are
    JSON of one, else their text as saved)."""
    f = call.get("function") or call
    args = f.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError:
            return str(f.get("name", "?")), args
    return str(f.get("name", "?")), args if isinstance(args, dict) else str(args)


def call_text(call: dict[str, Any]) -> str:
    """A saved call as one line: `name(key=value, ...)`, the values as JSON."""
    name, args = call_parts(call)
    if isinstance(args, str):
        return f"{name}({args})"
    return f"{name}(" + ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}"
                                  for k, v in args.items()) + ")"


def _conversation(row: sqlite3.Row) -> Conversation:
    ids = row["token_ids"]
    return Conversation(
        id=row["id"], title=row["title"], model=row["model"], system_prompt=row["system_prompt"],
        settings=json.loads(row["settings"] or "{}"),
        token_ids=json.loads(ids) if ids else None, updated=row["updated"])
