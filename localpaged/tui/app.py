"""`localpaged chat`: the Textual app. Tabs of conversations sharing one engine client.

The app holds no engine logic: it gets an `EngineClient` (or a `loader` that builds one from a
model name, run in a thread so a slow or failing load leaves the app usable) and streams from it.
Loaded models live in a `ModelPool` (the server's kind, shared with it under `--serve`): a
switch keeps the previous model loaded while the pool's limits allow, so switching back is
instant.
Building clients, attaching to a running server and `--serve` live in `localpaged.chat_launcher`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

from textual.app import App, SystemCommand
from textual.command import DiscoveryHit, Hit, Hits, Provider
from textual.screen import Screen

from localpaged.engine.client import EngineClient, EngineStats
from localpaged.engine.model_pool import Lease, ModelLoadError, ModelPool
from localpaged.tui.engine_screen import StatsHistory
from localpaged.tui.history import History, data_dir
from localpaged.tui.main_screen import ChatScreen
from localpaged.tui.session import ChatSettings, TurnTokenizer

Progress = Callable[[str], None]
Loader = Callable[[str, Progress], EngineClient]  # model name, progress -> client (in a thread)
KEPT_MODELS = 2  # the model in use and the previous one, when no pool is given


class ModelCommands(Provider):
    """Command palette entries "Switch model: NAME" for every pulled model."""

    def _names(self) -> list[str]:
        app = self.app
        if not isinstance(app, ChatApp) or app.list_models is None or app.loader is None:
            return []
        try:
            return app.list_models()
        except Exception:
            return []

    async def discover(self) -> Hits:
        app = self.app
        assert isinstance(app, ChatApp)
        for name in self._names():
            yield DiscoveryHit(f"Switch model: {name}", partial(app.load_model, name),
                               help="load this model for all tabs")

    async def search(self, query: str) -> Hits:
        app = self.app
        assert isinstance(app, ChatApp)
        matcher = self.matcher(query)
        for name in self._names():
            text = f"Switch model: {name}"
            if (score := matcher.match(text)) > 0:
                yield Hit(score, matcher.highlight(text), partial(app.load_model, name),
                          help="load this model for all tabs")


class ChatApp(App[None]):
    """The chat app. `client` may be given ready, or built by `loader(model)` at start."""

    TITLE = "localpaged"
    COMMANDS = App.COMMANDS | {ModelCommands}

    def __init__(
        self,
        history: History,
        *,
        client: EngineClient | None = None,
        model: str | None = None,
        loader: Loader | None = None,
        list_models: Callable[[], list[str]] | None = None,
        home: Path | None = None,
        owns_client: bool = True,
        default_settings: ChatSettings | None = None,
        pool: ModelPool | None = None,
    ) -> None:
        super().__init__()
        self.history = history
        self.client = client
        self.loader = loader
        if pool is None and loader is not None:
            pool = ModelPool(loader, max_loaded=KEPT_MODELS, keep_alive=-1)
        self.models = pool  # the loaded models (`loader`'s), None for a given client only
        self.lease: Lease | None = None  # the current model's, from `models`
        self.list_models = list_models
        self.data_dir = home or history.path.parent
        self.owns_client = owns_client
        self.requested_model = model or (client.model_name if client else "")
        self.loading: str | None = None
        self.load_error: str | None = None
        self.stats_history = StatsHistory()
        self.default_settings = default_settings or ChatSettings()

    # what the tabs need of the engine
    @property
    def model_name(self) -> str:
        return self.client.model_name if self.client is not None else self.requested_model

    @property
    def model_label(self) -> str:
        if self.load_error:
            return f"{self.requested_model}: failed to load ({self.load_error})"
        return self.model_name

    @property
    def tokenizer(self) -> TurnTokenizer | None:
        """The model's tokenizer when the client has one (for exact turns)."""
        tok = getattr(self.client, "tokenizer", None)
        ok = hasattr(tok, "next_turn_ids") and hasattr(tok, "apply_chat_template")
        return tok if ok else None

    @property
    def max_model_len(self) -> int:
        if self.client is None:
            return 0
        info = getattr(self.client, "model_info", None)
        return self.client.stats().max_model_len or getattr(info, "context_length", 0) or 0

    def sample_stats(self) -> EngineStats | None:
        """The engine's counters now (also recorded for the engine screen's sparklines)."""
        if self.client is None:
            return None
        stats = self.client.stats()
        self.stats_history.add(stats, time.monotonic())
        return stats

    def get_default_screen(self) -> Screen[None]:
        return ChatScreen()

    def on_mount(self) -> None:
        if self.client is None and self.loader is not None and self.requested_model:
            self.load_model(self.requested_model)

    async def on_unmount(self) -> None:
        from_pool = self.lease is not None
        if self.lease is not None:
            self.lease.release()
        if not self.owns_client:
            return
        if self.models is not None:
            await self.models.close()
        if self.client is not None and not from_pool:
            await self.client.close()

    # loading and switching models
    def load_model(self, name: str) -> None:
        """Load `name` in a thread (progress in the status line); all tabs switch to it."""
        self.run_worker(self._load(name), group="load", exclusive=True, exit_on_error=False)

    async def _load(self, name: str) -> None:
        if self.loader is None or self.models is None:
            self.notify("This app cannot switch models.", severity="warning")
            return
        self.requested_model = name
        self.load_error = None
        self._set_loading(f"loading {name}…")

        def progress(text: str) -> None:
            self.call_from_thread(self._set_loading, text)

        try:
            lease = await self.models.acquire(name, progress=progress)
        except Exception as exc:
            cause = exc.__cause__ if isinstance(exc, ModelLoadError) and exc.__cause__ else exc
            self.load_error = str(cause) or type(cause).__name__
            self._set_loading(None)
            self.notify(f"Could not load {name}: {self.load_error}", severity="error",
                        timeout=15)
            return
        old, self.lease = self.lease, lease
        client = self.client = lease.client
        screen = self._chat_screen()
        if screen is not None:
            for view in screen.views:
                await view.stop()
                view.session.set_model(client.model_name)
        if old is not None:  # the previous model stays loaded while the pool has room
            old.release()
        self._set_loading(None)
        self.notify(f"Model {client.model_name} loaded.")

    def _set_loading(self, text: str | None) -> None:
        self.loading = text
        if (screen := self._chat_screen()) is not None:
            screen.refresh_status()

    def _chat_screen(self) -> ChatScreen | None:
        for screen in self.screen_stack:
            if isinstance(screen, ChatScreen):
                return screen
        return None

    # the command palette
    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        chat = self._chat_screen()
        if chat is None:
            return
        yield SystemCommand("New tab", "Start a new conversation (ctrl+t)", chat.action_new_tab)
        yield SystemCommand("Settings", "System prompt and sampling of this tab (ctrl+o)",
                            chat.action_settings)
        yield SystemCommand("Engine", "Throughput, KV cache and counters (ctrl+g)",
                            chat.action_engine)
        yield SystemCommand("Export to Markdown", "Write this conversation to a .md file",
                            chat.action_export)
        yield SystemCommand("Chats", "Show or hide saved conversations (ctrl+b)",
                            chat.action_toggle_sidebar)
        yield SystemCommand("Regenerate", "Answer the last message again (ctrl+r)",
                            chat.action_regenerate)
        yield SystemCommand("Edit last message", "Take it back into the input (ctrl+e)",
                            chat.action_edit_last)
        yield SystemCommand("Copy last answer", "To the clipboard (ctrl+y)",
                            chat.action_copy_answer)
        yield SystemCommand("Copy last code block", "To the clipboard (ctrl+k)",
                            chat.action_copy_code)
        yield SystemCommand("Clear conversation", "Remove all messages of this tab (ctrl+l)",
                            chat.action_clear)


__all__ = ["ChatApp", "Loader", "data_dir"]
