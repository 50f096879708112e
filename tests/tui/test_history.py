"""The chat history database: conversations, messages, open tabs, search, export."""

from __future__ import annotations

from pathlib import Path

from localpaged.tui.history import History, data_dir


def test_roundtrip_and_reopen(tmp_path: Path) -> None:
    h = History(tmp_path / "h.sqlite3")
    assert h.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    cid = h.create("First", model="m", system_prompt="be brief", settings={"temperature": 0.0})
    h.add_message(cid, "user", "hello")
    mid = h.add_message(cid, "assistant", "", "streaming")
    h.update_message(mid, "partial answer")
    h.update_conversation(cid, token_ids=[1, 2, 3])
    h.set_open_tabs([cid])
    h.close()

    h2 = History(tmp_path / "h.sqlite3")
    conv = h2.load(cid)
    assert (conv.title, conv.model, conv.system_prompt) == ("First", "m", "be brief")
    assert conv.settings == {"temperature": 0.0} and conv.token_ids == [1, 2, 3]
    assert [(m.role, m.content, m.incomplete) for m in conv.messages] == [
        ("user", "hello", False), ("assistant", "partial answer", True)]
    assert h2.open_tabs() == [cid]
    assert h2.integrity_check() == "ok"


def test_list_search_rename_delete(tmp_path: Path) -> None:
    h = History(tmp_path / "h.sqlite3")
    a = h.create("Cooking")
    h.add_message(a, "user", "how long to boil an egg?")
    b = h.create("Rust lifetimes")
    assert [c.id for c in h.list()] == [b, a]  # most recent first
    assert [c.id for c in h.list("egg")] == [a]  # message text matches
    assert [c.id for c in h.list("rust")] == [b]  # title matches, case-insensitively
    h.rename(a, "Eggs")
    assert h.load(a).title == "Eggs"
    h.set_open_tabs([a, b])
    h.delete(a)
    assert [c.id for c in h.list()] == [b]
    assert h.open_tabs() == [b]
    assert h.db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0  # cascade


def test_export_markdown(tmp_path: Path) -> None:
    h = History(tmp_path / "h.sqlite3")
    cid = h.create("Demo", model="smollm2:135m", system_prompt="You are terse.")
    h.add_message(cid, "user", "Say hi")
    h.add_message(cid, "assistant", "```python\nprint('hi')\n```")
    h.add_message(cid, "user", "again")
    h.add_message(cid, "assistant", "hi hi", "streaming")
    md = h.export_markdown(cid)
    assert md.startswith("# Demo\n")
    assert "## System\n\nYou are terse." in md
    assert "## You\n\nSay hi" in md and "```python\nprint('hi')\n```" in md
    assert "## Assistant (incomplete)\n\nhi hi" in md


def test_clear_resets_token_ids(tmp_path: Path) -> None:
    h = History(tmp_path / "h.sqlite3")
    cid = h.create()
    h.add_message(cid, "user", "x")
    h.update_conversation(cid, token_ids=[5])
    h.clear(cid)
    conv = h.load(cid)
    assert conv.messages == [] and conv.token_ids is None


def test_data_dir_from_env(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LOCALPAGED_HOME", str(tmp_path / "home"))
    assert data_dir() == tmp_path / "home"
    assert History.in_data_dir().path == tmp_path / "home" / "history.sqlite3"
    monkeypatch.delenv("LOCALPAGED_HOME")
    assert data_dir().name == "localpaged"
