"""The sidebar of saved conversations: search, reopen (enter), rename (r), delete (d)."""

from __future__ import annotations

from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Input, Label, ListItem, ListView

from localpaged.tui.history import History


class ConversationItem(ListItem):
    def __init__(self, conv_id: int, title: str) -> None:
        super().__init__(Label(title))
        self.conv_id = conv_id


class ConversationList(ListView):
    """The list; r renames and d deletes the highlighted conversation."""

    BINDINGS: ClassVar[list[BindingType]] = [("r", "screen.rename_chat", "Rename"), ("d,delete", "screen.delete_chat", "Delete")]


class RenameScreen(ModalScreen[str | None]):
    """Ask for a new title."""

    DEFAULT_CSS = """
    RenameScreen { align: center middle; }
    RenameScreen > Vertical { width: 60; height: auto; padding: 1 2; border: thick $accent;
                              background: $surface; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [("escape", "cancel", "Cancel")]

    def __init__(self, title: str) -> None:
        super().__init__()
        self.old = title

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Rename conversation")
            yield Input(self.old, id="title")

    @on(Input.Submitted)
    def _done(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class Sidebar(Vertical):
    """Lists saved conversations; posts Reopen, Renamed and Deleted messages."""

    DEFAULT_CSS = """
    Sidebar { width: 32; height: 1fr; display: none; border-right: solid $panel-lighten-2; }
    Sidebar.shown { display: block; }
    Sidebar Input { margin: 0 0 1 0; }
    Sidebar ListView { height: 1fr; }
    """
    class Reopen(Message):
        def __init__(self, conv_id: int) -> None:
            super().__init__()
            self.conv_id = conv_id

    class Changed(Message):
        """A conversation was renamed (title set) or deleted (title None)."""

        def __init__(self, conv_id: int, title: str | None) -> None:
            super().__init__()
            self.conv_id = conv_id
            self.title = title

    def __init__(self, history: History) -> None:
        super().__init__(id="sidebar")
        self.history = history

    def compose(self) -> ComposeResult:
        yield Input(placeholder="Search chats", id="search")
        yield ConversationList(id="conversations")

    def on_mount(self) -> None:
        self.reload()

    def reload(self) -> None:
        search = self.query_one("#search", Input).value.strip()
        lv = self.query_one(ListView)
        lv.clear()
        lv.extend(ConversationItem(c.id, c.title) for c in self.history.list(search))

    @on(Input.Changed, "#search")
    def _search(self) -> None:
        self.reload()

    @on(Input.Submitted, "#search")
    def _to_list(self) -> None:
        self.query_one(ListView).focus()

    @on(ListView.Selected)
    def _selected(self, event: ListView.Selected) -> None:
        if isinstance(event.item, ConversationItem):
            self.post_message(self.Reopen(event.item.conv_id))

    def _current(self) -> ConversationItem | None:
        item = self.query_one(ListView).highlighted_child
        return item if isinstance(item, ConversationItem) else None

    def rename_highlighted(self) -> None:
        item = self._current()
        if item is None:
            return
        conv_id = item.conv_id

        def done(title: str | None) -> None:
            if title:
                self.history.rename(conv_id, title)
                self.post_message(self.Changed(conv_id, title))
                self.reload()

        self.app.push_screen(RenameScreen(self.history.load(conv_id).title), done)

    def delete_highlighted(self) -> None:
        item = self._current()
        if item is None:
            return
        self.history.delete(item.conv_id)
        self.post_message(self.Changed(item.conv_id, None))
        self.reload()
