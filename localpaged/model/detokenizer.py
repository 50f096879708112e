"""Incremental detokenization: text deltas as tokens arrive, vLLM's prefix/read offset method.

Each step decodes a short window of recent tokens twice: up to `read_offset` (text already
emitted) and to the end; the difference is the new text. A window whose text ends in U+FFFD
(a UTF-8 character split across tokens) waits for the next token, so no partial character is
ever emitted. Decoding a window instead of single tokens keeps the spaces that tokenizers
such as SentencePiece attach to word starts.
"""

from __future__ import annotations

from collections.abc import Sequence

from localpaged.model.tokenizer import Tokenizer

# Tokens of context the first window gets from `context_ids` (vLLM uses 5).
_CONTEXT = 5


class IncrementalDetokenizer:
    """add(token_ids) -> new text; `text` holds all text emitted so far."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        context_ids: Sequence[int] = (),
    ) -> None:
        """`context_ids` (e.g. the prompt's last tokens) only give the first output tokens
        their context; their own text is never emitted."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(context_ids)[-_CONTEXT:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._text)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete (may be "" while a character or a
        word is still split)."""
        self._ids.extend(int(t) for t in token_ids)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._text.append(delta)
        return delta

    def flush(self) -> str:
        """At the end of a sequence: emit whatever is held back, even an incomplete
        character (as U+FFFD, like a full decode would)."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        if delta:
            self._text.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""
