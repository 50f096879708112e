"""The per-tab settings modal: system prompt and sampling parameters."""

from __future__ import annotations

from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static, TextArea

from localpaged.tui.session import ChatSettings

FIELDS = [  # (field, label, kind)
    ("temperature", "Temperature", float),
    ("top_p", "Top-p", float),
    ("top_k", "Top-k (-1 off)", int),
    ("max_tokens", "Max tokens", int),
    ("seed", "Seed", int),
]

Result = tuple[str, ChatSettings]


class SettingsScreen(ModalScreen[Result | None]):
    """Edit a tab's system prompt and sampling settings; dismisses with them or None."""

    DEFAULT_CSS = """
    SettingsScreen { align: center middle; }
    SettingsScreen > Vertical {
        width: 90; height: auto; padding: 0 2; border: thick $accent; background: $surface;
    }
    SettingsScreen #system { height: 6; }
    SettingsScreen Grid { grid-size: 4; grid-columns: 18 1fr 18 1fr; grid-rows: 3;
                          height: auto; }
    SettingsScreen Grid Label { padding: 1 0; }
    SettingsScreen #error { color: $error; height: auto; }
    SettingsScreen #hint { color: $text-muted; }
    SettingsScreen Horizontal { height: auto; align-horizontal: right; }
    SettingsScreen Button { margin-left: 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [("escape", "cancel", "Cancel"), ("ctrl+s", "save", "Save")]

    def __init__(self, title: str, system_prompt: str, settings: ChatSettings) -> None:
        super().__init__()
        self.tab_title = title
        self.system_prompt = system_prompt
        self.settings = settings

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(f"[b]Settings of “{self.tab_title}”[/b]")
            yield Label("System prompt")
            yield TextArea(self.system_prompt, id="system")
            with Grid():
                for name, label, _ in FIELDS:
                    value = getattr(self.settings, name)
                    yield Label(label)
                    yield Input("" if value is None else str(value), id=name)
            yield Static("Temperature 0 is greedy; an empty seed is random.", id="hint")
            yield Static("", id="error")
            with Horizontal():
                yield Button("Cancel", id="cancel")
                yield Button("Save", id="save", variant="primary")

    def read(self) -> Result:
        """The values in the form (raises ValueError naming a bad field)."""
        values: dict[str, object] = {}
        for name, label, kind in FIELDS:
            raw = self.query_one(f"#{name}", Input).value.strip()
            if name == "seed" and not raw:
                values[name] = None
                continue
            try:
                values[name] = kind(raw)
            except ValueError:
                raise ValueError(f"{label}: {raw!r} is not a number") from None
        settings = ChatSettings(**values)  # type: ignore[arg-type]
        settings.params()
        return self.query_one("#system", TextArea).text, settings

    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        try:
            result = self.read()
        except ValueError as exc:
            self.query_one("#error", Static).update(str(exc))
            return
        self.dismiss(result)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
