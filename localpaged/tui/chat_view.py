"""The conversation pane of one tab: messages as Markdown, the prompt input, notices."""

from __future__ import annotations

import re
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, cast

from rich.text import Text
from textual import events, on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Button, Collapsible, Label, Markdown, Static, TextArea

from localpaged.model.thinking import OPEN, ThinkingSplitter, split_thinking
from localpaged.tui.history import StoredMessage, call_parts, call_text
from localpaged.tui.session import ChatSession, ContextOverflow

if TYPE_CHECKING:
    from localpaged.tui.app import ChatApp

CODE_BLOCK = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.S)


def last_code_block(text: str) -> str | None:
    """The body of the last fenced code block in `text` (an open one counts)."""
    blocks = CODE_BLOCK.findall(text)
    return blocks[-1].rstrip("\n") if blocks else None


class PromptInput(TextArea):
    """Multi-line input: enter sends; shift+enter, alt+enter or ctrl+j add a line."""

    class Submitted(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self.text))
        elif event.key in ("shift+enter", "alt+enter", "ctrl+j"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
        else:
            await super()._on_key(event)


def thinking_and_answer(message: StoredMessage) -> tuple[str, str]:
    """A saved answer's thinking block (folded in the view) and its answer; user messages and
    answers without a block are all answer."""
    if message.role != "assistant" or not message.content.lstrip().startswith(OPEN):
        return "", message.content
    return split_thinking(message.content)


def tool_call_names(messages: list[StoredMessage]) -> dict[int, str]:
    """The function each saved tool result answers (by message id): the call its
    `tool_call_id` names, else the earliest call not answered yet."""
    pending: list[tuple[Any, str]] = []  # (id, function) of calls not answered yet
    names: dict[int, str] = {}
    for m in messages:
        pending += [(c.get("id"), call_parts(c)[0]) for c in m.tool_calls or []]
        if m.role == "tool" and pending:
            at = next((i for i, (cid, _) in enumerate(pending)
                       if cid is not None and cid == m.tool_call_id), 0)
            names[m.id] = pending.pop(at)[1]
    return names


class ToolCallView(Static):
    """One tool call of a saved answer, compactly: the function and its arguments."""

    DEFAULT_CSS = """
    ToolCallView { margin: 0 0 0 2; padding: 0 1; border-left: outer $accent;
                   background: $boost; color: $text; }
    """

    def __init__(self, call: dict[str, Any]) -> None:
        self.call = call
        name, _ = call_parts(call)
        args = call_text(call)[len(name):]
        super().__init__(Text.assemble(("⚙ ", "bold"), (name, "bold"), args),
                         classes="tool-call")


class ToolResultView(Static):
    """A tool's result: which function it came from, and what it returned."""

    DEFAULT_CSS = """
    ToolResultView { margin: 0 0 0 2; padding: 0 1; border-left: outer $success;
                     background: $boost; color: $text-muted; }
    """

    def __init__(self, message: StoredMessage, name: str | None) -> None:
        head = f"↳ {name or 'tool'} returned: "
        body = message.content if len(message.content) <= 2000 else message.content[:2000] + " …"
        super().__init__(Text.assemble((head, "bold"), body), classes="tool-result")


class MessageView(Vertical):
    """One message: a role line, a thinking model's thinking folded (a toggle opens it), and
    its Markdown body."""

    DEFAULT_CSS = """
    MessageView { height: auto; margin: 0 1 1 1; }
    MessageView.tool { margin-top: -1; }
    MessageView .role { color: $text-muted; text-style: bold; }
    MessageView.user .role { color: $accent; }
    MessageView.assistant .role { color: $success; }
    MessageView .incomplete { color: $warning; }
    MessageView Markdown { margin: 0; padding: 0 0 0 2; }
    MessageView Markdown > MarkdownBlock:last-child { margin-bottom: 0; }
    MessageView Collapsible { margin: 0 0 0 2; padding: 0; border: none; }
    MessageView Collapsible .thought { color: $text-muted; text-style: italic; }
    """

    def __init__(self, message: StoredMessage, *, streaming: bool = False,
                 call_name: str | None = None) -> None:
        super().__init__(classes=message.role)
        self.message = message
        self.call_name = call_name  # a tool result's function
        self.streaming = streaming  # the body starts empty and is fed by a MarkdownStream
        self.thought, self.answer = ("", "") if streaming else thinking_and_answer(message)

    def compose(self) -> ComposeResult:
        if self.message.role == "tool":  # a tool's result, under the call it answers
            yield ToolResultView(self.message, self.call_name)
            return
        yield Label("You" if self.message.role == "user" else "Assistant", classes="role")
        thinking = Collapsible(Static(self.thought, classes="thought"), title="Thinking",
                               collapsed=True)
        thinking.display = bool(self.thought)
        yield thinking
        body = Markdown(self.answer)
        body.display = bool(self.answer) or self.streaming or not self.message.tool_calls
        yield body
        for call in self.message.tool_calls or []:
            yield ToolCallView(call)
        yield Label(self._note(), classes="incomplete")

    def add_thinking(self, text: str) -> None:
        """More of a streaming answer's thinking (shown folded)."""
        self.thought += text
        self.query_one(".thought", Static).update(self.thought)
        self.query_one(Collapsible).display = True

    def _note(self) -> str:
        if self.streaming and self.message.status == "streaming":
            return ""  # live: it is being written now
        return {"streaming": "⚠ incomplete: the app stopped during this answer",
                "stopped": "■ stopped"}.get(self.message.status, "")

    @property
    def body(self) -> Markdown:
        return self.query_one(Markdown)

    def refresh_note(self) -> None:
        if self.message.role != "tool":
            self.query_one(".incomplete", Label).update(self._note())


def message_views(messages: list[StoredMessage]) -> list[MessageView]:
    """The views of saved messages (a tool result knowing its call's function)."""
    names = tool_call_names(messages)
    return [MessageView(m, call_name=names.get(m.id)) for m in messages]


class Notice(Horizontal):
    """A line above the input: errors and the context-overflow offer."""

    DEFAULT_CSS = """
    Notice { height: auto; display: none; margin: 0 1; }
    Notice.shown { display: block; }
    Notice Static { width: 1fr; color: $error; }
    Notice Button { display: none; }
    Notice.offer Button { display: block; }
    """

    def compose(self) -> ComposeResult:
        yield Static("", id="notice-text")
        yield Button("Drop oldest turns", id="drop-oldest", variant="warning")

    def show(self, text: str, *, offer: bool = False) -> None:
        self.query_one("#notice-text", Static).update(text)
        self.set_class(True, "shown")
        self.set_class(offer, "offer")

    def hide(self) -> None:
        self.set_class(False, "shown", "offer")


class ChatLog(VerticalScroll, can_focus=False):
    """The messages; scrolled by the mouse and as answers stream, never focused (so switching
    tabs puts the focus in the input)."""


class ChatView(Vertical):
    """A tab's conversation. Streams answers in a worker, so tabs stream concurrently."""

    DEFAULT_CSS = """
    ChatView { height: 1fr; }
    ChatView #log { height: 1fr; }
    ChatView PromptInput { height: auto; min-height: 3; max-height: 10; width: 1fr; margin: 0 1; }
    """

    class BusyChanged(Message):
        """An answer started or ended in this tab."""

        def __init__(self, view: ChatView) -> None:
            super().__init__()
            self.view = view

    def __init__(self, session: ChatSession, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.session = session

    @property
    def chat_app(self) -> ChatApp:
        return cast("ChatApp", self.app)

    def compose(self) -> ComposeResult:
        with ChatLog(id="log"):
            yield from message_views(self.session.messages)
        yield Notice()
        yield PromptInput(id="prompt", placeholder="Message (enter sends, ctrl+j new line)")

    @property
    def prompt(self) -> PromptInput:
        return self.query_one(PromptInput)

    def focus_input(self) -> None:
        self.prompt.focus()

    @on(PromptInput.Submitted)
    def _submitted(self, event: PromptInput.Submitted) -> None:
        self.send(event.text)

    def send(self, text: str) -> bool:
        """Send a user message; False (and nothing sent) if it is empty or a turn is running."""
        if not text.strip():
            return False
        if self.session.busy:
            self.app.notify("This tab is still answering (escape stops it).", severity="warning")
            return False
        if self.chat_app.client is None:
            self.app.notify("No model is loaded yet.", severity="warning")
            return False
        msg = self.session.add_user(text)
        self.prompt.clear()
        self.query_one(Notice).hide()
        self.query_one("#log").mount(MessageView(msg))
        self._start_answer()
        return True

    def _start_answer(self) -> None:
        self.run_worker(self._answer(), group="answer", exclusive=True, exit_on_error=False)

    async def _answer(self) -> None:
        app = self.chat_app
        client = app.client
        if client is None:
            return
        log = self.query_one("#log", ChatLog)
        view: MessageView | None = None
        stream = None
        splitter: ThinkingSplitter | None = None
        try:
            turn = self.session.stream_turn(client, app.tokenizer, app.max_model_len)
            async with aclosing(turn) as deltas:
                async for delta in deltas:
                    if view is None:
                        view = MessageView(self.session.messages[-1], streaming=True)
                        await log.mount(view)
                        stream = Markdown.get_stream(view.body)
                        self.post_message(self.BusyChanged(self))
                        if self.session.thinks or delta.text.lstrip().startswith(OPEN):
                            # (a remote thinking model's answer starts with its block)
                            splitter = ThinkingSplitter(self.session.thinking_opened)
                    assert stream is not None
                    if splitter is None:
                        await stream.write(delta.text)
                    else:
                        thought, answer = splitter.feed(delta.text, final=delta.finished)
                        if thought:
                            view.add_thinking(thought)
                        if answer:
                            await stream.write(answer)
                    if delta.finished and delta.finish_reason == "error":
                        await stream.write(f"\n\n**Error:** {delta.error}")
                    log.scroll_end(animate=False)
        except ContextOverflow as exc:
            if sum(m.role == "user" for m in self.session.messages) > 1:
                self.query_one(Notice).show(f"{exc} Drop the oldest turns to make room?",
                                            offer=True)
            else:
                self.query_one(Notice).show(f"{exc} Shorten the message (ctrl+e edits it).")
        except ValueError as exc:
            self.query_one(Notice).show(f"Not sent: {exc}")
        finally:
            if stream is not None:
                await stream.stop()
            if view is not None:
                view.refresh_note()
            self.post_message(self.BusyChanged(self))

    async def stop(self) -> None:
        """Stop the answer streaming in this tab (the partial answer is kept)."""
        rid, client = self.session.request_id, self.chat_app.client
        if rid is not None and client is not None:
            await client.abort(rid)

    async def regenerate(self) -> None:
        """Answer the last user message again."""
        if self.session.busy or not self.session.messages:
            return
        if self.session.drop_last_answer():
            await self.query(MessageView).last().remove()
        if self.session.messages and self.session.messages[-1].role == "user":
            self._start_answer()

    async def edit_last(self) -> None:
        """Take the last user message (and its answer) back into the input."""
        if self.session.busy:
            return
        n_before = len(self.session.messages)
        text = self.session.pop_last_user()
        if text is None:
            return
        views = list(self.query(MessageView))
        for v in views[len(self.session.messages):n_before]:
            await v.remove()
        self.prompt.load_text(text)
        self.prompt.move_cursor(self.prompt.document.end)
        self.focus_input()

    async def clear(self) -> None:
        if self.session.busy:
            await self.stop()
        self.session.clear()
        await self.query(MessageView).remove()
        self.query_one(Notice).hide()

    @on(Button.Pressed, "#drop-oldest")
    async def _drop_oldest(self) -> None:
        """Drop oldest turns until the prompt fits (or one turn is left), then resend."""
        self.query_one(Notice).hide()
        app = self.chat_app
        tok, limit = app.tokenizer, app.max_model_len
        while self.session.drop_oldest_turn():
            if tok is None or not limit or len(self.session.prompt_ids(tok)) < limit:
                break
        await self.query(MessageView).remove()
        await self.query_one("#log").mount_all(message_views(self.session.messages))
        self._start_answer()

    def last_answer(self) -> str | None:
        for m in reversed(self.session.messages):
            if m.role == "assistant":
                return thinking_and_answer(m)[1]  # without a thinking model's thinking
        return None
