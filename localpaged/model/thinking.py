"""The thinking of reasoning models (Qwen3, DeepSeek-R1 distills) apart from their answer.

Such a model writes `<think> ... </think>` before the answer, or its chat template opens the
block itself (the generation prompt ends in `<think>`), so the output starts inside it. Only a
block at the very start of the output is thinking; the newlines around it are layout. A
template that knows thinking (it names `<think>`) also has its own rule for past turns (Qwen3's
and R1's drop the thinking of earlier answers): the answer text with its block is what a chat
keeps, and the template decides what the next prompt shows.
"""

from __future__ import annotations

from typing import Any

OPEN, CLOSE = "<think>", "</think>"


def template_thinks(template: str | None) -> bool:
    """Whether a chat template is a thinking model's (it writes or strips `<think>` blocks)."""
    return bool(template) and OPEN in template  # type: ignore[operator]


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside a thinking block (the template opened it)."""
    return prompt_text.rstrip().endswith(OPEN)


def thinking_of(tokenizer: Any, messages: list[dict[str, Any]],
                **template_vars: Any) -> tuple[bool, bool]:
    """(the model thinks, the prompt for `messages` opens the block) from its tokenizer's chat
    template; (False, False) without one."""
    if not template_thinks(getattr(tokenizer, "chat_template", None)):
        return False, False
    try:
        return True, prompt_opens_thinking(tokenizer.render_chat(messages, **template_vars))
    except Exception:  # a template that rejects the conversation: no opened block known
        return True, False


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag` (kept until the
    next piece says)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkingSplitter:
    """Splits streamed output text into (thinking, answer) pieces as it arrives: `feed` each
    delta, then `flush` at the end. `opened`: the prompt already opened the block."""

    def __init__(self, opened: bool = False) -> None:
        self.state = "thinking" if opened else "start"
        self.pending = ""
        self.thinking_started = False  # leading newlines of the thinking are dropped
        self.answer_started = False  # and those of the answer after the block

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The thinking and the answer text that `text` completes (either may be ""); with
        `final` (the output's last piece) also what was held back."""
        thinking, answer = self._feed(text)
        if final:
            rest = self.flush()
            thinking, answer = thinking + rest[0], answer + rest[1]
        return thinking, answer

    def _feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        thinking, answer = "", ""
        if self.state == "start":
            head = self.pending.lstrip()
            if head.startswith(OPEN):
                self.state, self.pending = "thinking", head[len(OPEN):]
            elif OPEN.startswith(head):
                return "", ""  # whitespace or part of the tag so far: wait
            else:
                self.state = "answer"
        if self.state == "thinking":
            end = self.pending.find(CLOSE)
            if end >= 0:
                thinking = self._thinking_text(self.pending[:end].rstrip("\n"))
                self.state, self.pending = "answer", self.pending[end + len(CLOSE):]
            else:  # keep a possible partial tag, and trailing newlines (they may end it)
                keep = held_back(self.pending, CLOSE)
                body = self.pending[: len(self.pending) - keep]
                ready = body.rstrip("\n")
                thinking = self._thinking_text(ready)
                self.pending = self.pending[len(ready):]
                return thinking, ""
        if self.state == "answer":
            answer, self.pending = self.pending, ""
            if not self.answer_started:
                answer = answer.lstrip("\n")
                self.answer_started = bool(answer)
        return thinking, answer

    def _thinking_text(self, text: str) -> str:
        if not self.thinking_started:
            text = text.lstrip("\n")
            self.thinking_started = bool(text)
        return text

    def flush(self) -> tuple[str, str]:
        """What is still held back at the end of the output."""
        rest, self.pending = self.pending, ""
        if self.state == "thinking":  # the block never closed: all of it was thinking
            return self._thinking_text(rest.rstrip("\n")), ""
        if self.state == "start":  # only whitespace or a partial tag: an answer
            return "", rest if self.answer_started else rest.lstrip("\n")
        return "", rest


def split_thinking(text: str, opened: bool = False) -> tuple[str, str]:
    """(thinking, answer) of a whole output text."""
    return ThinkingSplitter(opened).feed(text, final=True)
