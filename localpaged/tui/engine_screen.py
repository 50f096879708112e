"""The engine screen: live sparklines of throughput and KV use, and the engine's counters
(with the inter-token gaps' p50 / p99 and the step-time bound in force)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Footer, Label, Sparkline, Static

from localpaged.engine.client import EngineStats

SAMPLES = 120


class StatsHistory:
    """Recent engine samples: generated tokens/s and KV blocks in use (%), one per tick."""

    def __init__(self, size: int = SAMPLES) -> None:
        self.throughput: deque[float] = deque([0.0] * size, maxlen=size)
        self.kv_use: deque[float] = deque([0.0] * size, maxlen=size)
        self.last: EngineStats | None = None
        self._prev: tuple[float, int] | None = None

    def add(self, stats: EngineStats, now: float) -> None:
        if self._prev is not None and now > self._prev[0]:
            made = max(0, stats.generation_tokens_total - self._prev[1])
            self.throughput.append(made / (now - self._prev[0]))
        self._prev = (now, stats.generation_tokens_total)
        total = stats.kv_blocks_total
        self.kv_use.append(100.0 * stats.kv_blocks_used / total if total else 0.0)
        self.last = stats


def describe(stats: EngineStats | None) -> str:
    """The counters as text lines."""
    if stats is None:
        return "No engine loaded."
    return "\n".join([
        f"model              {stats.model} on {stats.device}",
        f"running / waiting  {stats.num_running} / {stats.num_waiting}",
        f"KV blocks          {stats.kv_blocks_used} / {stats.kv_blocks_total}"
        f" (block size {stats.block_size})",
        f"prefix cache       {stats.prefix_cache_hits} / {stats.prefix_cache_queries} tokens hit"
        f" ({stats.prefix_cache_hit_rate:.0%})",
        f"prompt tokens      {stats.prompt_tokens_total} computed",
        f"generated tokens   {stats.generation_tokens_total}",
        f"preemptions        {stats.num_preemptions}",
        f"steps              {stats.steps}",
        f"inter-token gap    {describe_gaps(stats)}",
        f"step bound         {stats.step_bound}",
        f"max model len      {stats.max_model_len}",
    ])


def describe_gaps(stats: EngineStats) -> str:
    """p50 / p99 of the time between two tokens of a request, over the recent tokens."""
    itl = stats.inter_token_latency
    if not itl.recent:
        return "no tokens yet"
    return (f"p50 {itl.p50 * 1e3:.1f} ms, p99 {itl.p99 * 1e3:.1f} ms "
            f"(last {len(itl.recent)} tokens)")


class EngineScreen(Screen[None]):
    """Sparklines and counters of the shared engine (escape goes back)."""

    DEFAULT_CSS = """
    EngineScreen > Vertical { padding: 1 2; }
    EngineScreen Sparkline { height: 4; margin-bottom: 1; }
    EngineScreen .title { text-style: bold; }
    EngineScreen #counters { margin-top: 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [("escape", "app.pop_screen", "Back")]

    def __init__(self, history: StatsHistory, sample: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.history = history
        self.sample = sample

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Throughput (generated tokens/s)", classes="title")
            yield Label("", id="tput-now")
            yield Sparkline(list(self.history.throughput), id="throughput")
            yield Label("KV cache use (% of blocks)", classes="title")
            yield Label("", id="kv-now")
            yield Sparkline(list(self.history.kv_use), id="kv",
                            summary_function=max)
            yield Static(describe(self.history.last), id="counters")
        yield Footer()

    def on_mount(self) -> None:
        self.refresh_data()
        self.set_interval(0.5, self.refresh_data)

    def refresh_data(self) -> None:
        if self.sample is not None:
            self.sample()
        h = self.history
        self.query_one("#throughput", Sparkline).data = list(h.throughput)
        self.query_one("#kv", Sparkline).data = list(h.kv_use)
        self.query_one("#tput-now", Label).update(f"now {h.throughput[-1]:.1f} tok/s")
        self.query_one("#kv-now", Label).update(f"now {h.kv_use[-1]:.0f}%")
        self.query_one("#counters", Static).update(describe(h.last))
