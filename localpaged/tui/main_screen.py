"""The main screen: conversation tabs, the sidebar of saved chats and the status line."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar, cast

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import Footer, TabbedContent, TabPane

from localpaged.tui.chat_view import ChatView, last_code_block
from localpaged.tui.engine_screen import EngineScreen
from localpaged.tui.session import ChatSession
from localpaged.tui.settings import Result, SettingsScreen
from localpaged.tui.sidebar import Sidebar
from localpaged.tui.status import StatusLine, format_status

if TYPE_CHECKING:
    from localpaged.tui.app import ChatApp

BUSY = "● "


def tab_label(session: ChatSession, index: int) -> str:
    title = session.title if len(session.title) <= 22 else session.title[:21] + "…"
    return f"{BUSY if session.busy else ''}{index}: {title}"


class ChatScreen(Screen[None]):
    """Tabs of conversations sharing one engine."""

    DEFAULT_CSS = """
    ChatScreen #body { height: 1fr; }
    ChatScreen #tabs { height: 1fr; width: 1fr; }
    ChatScreen TabPane { padding: 0; height: 1fr; }
    ChatScreen ContentSwitcher { height: 1fr; }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+t", "new_tab", "New tab", priority=True),
        Binding("ctrl+w", "close_tab", "Close tab", priority=True),
        Binding("ctrl+pageup", "switch_tab(-1)", "Previous tab", show=False, priority=True),
        Binding("ctrl+pagedown", "switch_tab(1)", "Next tab", show=False, priority=True),
        *[Binding(f"alt+{i}", f"go_tab({i})", f"Tab {i}", show=False, priority=True)
          for i in range(1, 10)],
        Binding("escape", "stop", "Stop", priority=True),
        Binding("ctrl+r", "regenerate", "Regenerate", priority=True),
        Binding("ctrl+e", "edit_last", "Edit last", show=False, priority=True),
        Binding("ctrl+y", "copy_answer", "Copy answer", show=False, priority=True),
        Binding("ctrl+k", "copy_code", "Copy code", show=False, priority=True),
        Binding("ctrl+l", "clear", "Clear", show=False, priority=True),
        Binding("ctrl+o", "settings", "Settings", priority=True),
        Binding("ctrl+b", "toggle_sidebar", "Chats", priority=True),
        Binding("ctrl+g", "engine", "Engine", priority=True),
    ]

    @property
    def chat_app(self) -> ChatApp:
        return cast("ChatApp", self.app)

    def compose(self) -> ComposeResult:
        with Horizontal(id="body"):
            yield Sidebar(self.chat_app.history)
            yield TabbedContent(id="tabs")
        yield StatusLine(id="status")
        yield Footer()

    async def on_mount(self) -> None:
        app = self.chat_app
        for conv_id in app.history.open_tabs():
            try:
                await self.open_conversation(conv_id, save=False)
            except KeyError:
                continue
        if not self.views:
            await self.action_new_tab()
        self.action_go_tab(1)
        self.save_tabs()
        self.refresh_status()
        self.set_interval(0.5, self.refresh_status)

    # tabs
    @property
    def tabs(self) -> TabbedContent:
        return self.query_one("#tabs", TabbedContent)

    @property
    def views(self) -> list[ChatView]:
        return list(self.query(ChatView))

    @property
    def current(self) -> ChatView | None:
        pane = self.tabs.active_pane
        return pane.query_one(ChatView) if pane is not None else None

    def save_tabs(self) -> None:
        self.chat_app.history.set_open_tabs([v.session.conv_id for v in self.views])

    def relabel(self) -> None:
        for i, view in enumerate(self.views, 1):
            self.tabs.get_tab(f"conv-{view.session.conv_id}").label = tab_label(view.session, i)

    async def add_session(self, session: ChatSession, *, save: bool = True) -> ChatView:
        view = ChatView(session)
        pane = TabPane(tab_label(session, len(self.views) + 1), view, id=f"conv-{session.conv_id}")
        await self.tabs.add_pane(pane)
        self.tabs.active = pane.id or ""
        view.focus_input()
        self.call_after_refresh(view.focus_input)  # once the pane is shown
        if save:
            self.save_tabs()
        return view

    async def open_conversation(self, conv_id: int, *, save: bool = True) -> ChatView:
        """Focus the tab of a saved conversation, opening it if needed."""
        for view in self.views:
            if view.session.conv_id == conv_id:
                self.tabs.active = f"conv-{conv_id}"
                return view
        app = self.chat_app
        conv = app.history.load(conv_id)
        model = app.client.model_name if app.client is not None else None
        return await self.add_session(
            ChatSession.from_conversation(app.history, conv, model), save=save)

    async def action_new_tab(self) -> None:
        app = self.chat_app
        settings = replace(app.default_settings)
        await self.add_session(ChatSession.new(app.history, app.model_name, settings=settings))

    async def action_close_tab(self) -> None:
        view = self.current
        if view is None:
            return
        await view.stop()
        session = view.session
        await self.tabs.remove_pane(f"conv-{session.conv_id}")
        if not session.messages:
            self.chat_app.history.delete(session.conv_id)
        if not self.views:
            await self.action_new_tab()
        self.save_tabs()
        self.relabel()
        self._focus_current()

    def action_switch_tab(self, step: int) -> None:
        views = self.views
        cur = self.current
        if not views or cur is None:
            return
        self.tabs.active = f"conv-{views[(views.index(cur) + step) % len(views)].session.conv_id}"
        self._focus_current()

    def action_go_tab(self, n: int) -> None:
        views = self.views
        if 1 <= n <= len(views):
            self.tabs.active = f"conv-{views[n - 1].session.conv_id}"
            self._focus_current()

    def _focus_current(self) -> None:
        if (view := self.current) is not None:
            view.focus_input()

    @on(TabbedContent.TabActivated)
    def _tab_activated(self) -> None:
        self.refresh_status()
        self.call_after_refresh(self._refocus)

    def _refocus(self) -> None:
        """Focus the active tab's input, unless the user is in the sidebar."""
        sidebar = self.query_one(Sidebar)
        if not sidebar.has_focus_within and not sidebar.has_class("shown"):
            self._focus_current()

    @on(ChatView.BusyChanged)
    def _busy_changed(self) -> None:
        self.relabel()
        self.refresh_status()
        self.query_one(Sidebar).reload()

    def refresh_status(self) -> None:
        line = self.query_one_optional(StatusLine)
        if line is None or not self.query("#tabs"):  # not composed yet
            return
        app = self.chat_app
        stats = app.sample_stats()
        view = self.current
        line.show(format_status(
            app.model_label, stats, view.session.stats if view else None, loading=app.loading))

    # the conversation
    async def action_stop(self) -> None:
        if (view := self.current) is not None:
            await view.stop()

    async def action_regenerate(self) -> None:
        if (view := self.current) is not None:
            await view.regenerate()

    async def action_edit_last(self) -> None:
        if (view := self.current) is not None:
            await view.edit_last()

    async def action_clear(self) -> None:
        if (view := self.current) is not None:
            await view.clear()
            self.relabel()

    def action_copy_answer(self) -> None:
        view = self.current
        text = view.last_answer() if view else None
        if text:
            self.app.copy_to_clipboard(text)
            self.notify("Copied the last answer.")

    def action_copy_code(self) -> None:
        view = self.current
        code = last_code_block(view.last_answer() or "") if view else None
        if code is None:
            self.notify("No code block in the last answer.", severity="warning")
            return
        self.app.copy_to_clipboard(code)
        self.notify("Copied the last code block.")

    def action_settings(self) -> None:
        view = self.current
        if view is None:
            return
        s = view.session

        def done(result: Result | None) -> None:
            if result is not None:
                s.configure(*result)

        self.app.push_screen(SettingsScreen(s.title, s.system_prompt, s.settings), done)

    def action_engine(self) -> None:
        app = self.chat_app
        self.app.push_screen(EngineScreen(app.stats_history, app.sample_stats))

    def action_export(self) -> None:
        view = self.current
        if view is None:
            return
        app = self.chat_app
        slug = re.sub(r"[^a-zA-Z0-9]+", "-", view.session.title).strip("-").lower() or "chat"
        path = app.data_dir / "exports" / f"{slug}-{view.session.conv_id}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(app.history.export_markdown(view.session.conv_id), encoding="utf-8")
        self.notify(f"Exported to {path}")

    # the sidebar
    def action_toggle_sidebar(self) -> None:
        sidebar = self.query_one(Sidebar)
        shown = not sidebar.has_class("shown")
        sidebar.set_class(shown, "shown")
        if shown:
            sidebar.reload()
            sidebar.query_one("#conversations").focus()
        else:
            self._focus_current()

    def action_rename_chat(self) -> None:
        self.query_one(Sidebar).rename_highlighted()

    def action_delete_chat(self) -> None:
        self.query_one(Sidebar).delete_highlighted()

    @on(Sidebar.Reopen)
    async def _reopen(self, event: Sidebar.Reopen) -> None:
        view = await self.open_conversation(event.conv_id)
        view.focus_input()

    @on(Sidebar.Changed)
    async def _changed(self, event: Sidebar.Changed) -> None:
        for view in self.views:
            if view.session.conv_id != event.conv_id:
                continue
            if event.title is None:  # deleted: close its tab
                await view.stop()
                await self.tabs.remove_pane(f"conv-{event.conv_id}")
                if not self.views:
                    await self.action_new_tab()
                self.save_tabs()
            else:
                view.session.title = event.title
        self.relabel()
