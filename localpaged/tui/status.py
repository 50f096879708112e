"""The status line: model and device, KV blocks, prefix-cache hit rate, this tab's turn."""

from __future__ import annotations

from textual.widgets import Static

from localpaged.engine.client import EngineStats
from localpaged.tui.session import TurnStats


def format_status(model: str, stats: EngineStats | None, turn: TurnStats | None,
                  *, loading: str | None = None) -> str:
    """One line of text; parts the engine does not know are left out."""
    if loading:
        return f"⏳ {loading}"
    if stats is None:
        return f"{model or 'no model'} │ not loaded"
    parts = [f"{model} · {stats.device}"]
    if stats.kv_blocks_total:
        parts.append(f"KV {stats.kv_blocks_used}/{stats.kv_blocks_total}")
        parts.append(f"prefix hits {stats.prefix_cache_hit_rate:.0%}")
    parts.append(f"queued {stats.num_waiting}")
    if turn is not None and turn.prompt_tokens:
        parts.append(f"reused {turn.cached_tokens}/{turn.prompt_tokens} tok")
    if turn is not None and turn.ttft_s is not None:
        parts.append(f"TTFT {turn.ttft_s * 1000:.0f} ms")
    if turn is not None and turn.tokens_per_s is not None:
        parts.append(f"{turn.tokens_per_s:.1f} tok/s")
    return " │ ".join(parts)


class StatusLine(Static):
    """Above the footer; the screen refreshes it on a timer and on turn events."""

    DEFAULT_CSS = """
    StatusLine { height: 1; padding: 0 1; background: $panel; color: $text; }
    """

    def show(self, text: str) -> None:
        if str(self.content) != text:
            self.update(text)
