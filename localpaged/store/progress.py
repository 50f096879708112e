"""Pull progress: one event type, a terminal renderer for the CLI, callbacks for the API."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO


@dataclass
class PullProgress:
    """One progress event, shaped like Ollama's /api/pull stream (status, completed, total)."""

    status: str
    completed: int = 0  # bytes done, across all files of this pull
    total: int = 0  # bytes in all, 0 while unknown
    file: str | None = None


ProgressFn = Callable[[PullProgress], None]


def human_size(n: float) -> str:
    """`1536` -> `1.5 KB`."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover


class TerminalProgress:
    """Prints status lines on stderr, and a redrawn byte counter when stderr is a terminal."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._last_status = ""
        self._last_draw = 0.0
        self._bar_open = False

    def __call__(self, event: PullProgress) -> None:
        if event.status != self._last_status:
            self._end_bar()
            print(event.status, file=self.stream, flush=True)
            self._last_status = event.status
            return
        if not self.tty or not event.total:
            return
        now = time.monotonic()
        if now - self._last_draw < 0.1 and event.completed < event.total:
            return
        self._last_draw = now
        pct = 100 * event.completed / event.total
        width = 30
        filled = int(width * event.completed / event.total)
        self.stream.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {pct:5.1f}% "
                          f"{human_size(event.completed)} / {human_size(event.total)}")
        self.stream.flush()
        self._bar_open = True

    def _end_bar(self) -> None:
        if self._bar_open:
            self.stream.write("\n")
            self._bar_open = False


def _silent(event: PullProgress) -> None:
    return None


def reporter(progress: bool | ProgressFn | None) -> ProgressFn:
    """`True`: the terminal renderer; `False`/None: silent; a callable: itself."""
    if callable(progress):
        return progress
    return TerminalProgress() if progress else _silent


class ByteCounter:
    """Counts bytes of one pull across its files and reports them; also a factory of
    tqdm-like objects for huggingface_hub's `tqdm_class`."""

    def __init__(self, report: ProgressFn, total: int) -> None:
        self.report = report
        self.total = total
        self.completed = 0
        self.status = ""
        self.file: str | None = None

    def start(self, status: str, file: str | None = None) -> None:
        self.status, self.file = status, file
        self.report(PullProgress(status, self.completed, self.total, file))

    def add(self, n: int) -> None:
        self.completed += n
        self.report(PullProgress(self.status, self.completed, self.total, self.file))

    def tqdm_class(self) -> type:
        """A class huggingface_hub can instantiate as its progress bar."""
        counter = self

        class _Bar:
            def __init__(self, *args: Any, initial: int = 0, **kwargs: Any) -> None:
                if initial:
                    counter.add(initial)

            def __enter__(self) -> _Bar:
                return self

            def __exit__(self, *exc: object) -> None:
                return None

            def update(self, n: int | float = 1) -> None:
                counter.add(int(n))

            def close(self) -> None:
                return None

        return _Bar
