"""Incremental text of one request's answer, with stop strings cut out before they leak."""

from __future__ import annotations

from typing import Any


class StopChecker:
    """Detokenizes a request's tokens as they come and watches for its stop strings.

    While the answer runs, the last `len(longest stop) - 1` characters are held back: they
    could be the start of a stop string, which must never reach the user."""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.detok = None
        if tokenizer is not None:
            from localpaged.model.detokenizer import IncrementalDetokenizer

            self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def add(self, token_id: int, final: bool) -> tuple[str, str | None]:
        """Take one new token. Returns (text safe to show now, the stop string hit or None)."""
        if self.stopped or self.detok is None:
            return "", None
        new = self.detok.add([token_id])
        search_from = max(0, len(self.text) - self.hold)
        self.text += new
        hit, cut = None, len(self.text)
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i != -1 and i < cut:
                hit, cut = s, i
        if hit is not None:
            self.text = self.text[:cut]
            self.stopped = final = True
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        delta, self.emitted = self.text[self.emitted:end], end
        return delta, hit

    def flush(self) -> str:
        """Whatever is still held back (at the end of the answer)."""
        rest, self.emitted = self.text[self.emitted:], len(self.text)
        return rest
