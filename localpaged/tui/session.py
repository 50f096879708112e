"""One tab's conversation: its messages, settings, exact token ids and the turn loop.

No widgets here: `ChatSession.stream_turn` talks to an `EngineClient`, keeps the history
database up to date and yields the deltas for the view to render.

Exact turns (DESIGN.md): with a client that exposes a tokenizer, the session keeps the token
ids of the whole conversation (last prompt + answer), and the next prompt is built by
`tokenizer.next_turn_ids`, so it starts with exactly those ids and reuses their KV blocks.
Clients without a tokenizer (remote servers) get the messages instead.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from localpaged.engine.client import EngineClient, Message, StreamDelta
from localpaged.engine.request import SamplingParams
from localpaged.model.thinking import OPEN, thinking_of
from localpaged.tui.history import Conversation, History, StoredMessage

SAVE_EVERY_S = 0.5  # a streaming answer is saved at least this often


class TurnTokenizer(Protocol):
    """What the session needs of the model's tokenizer for exact turns."""

    def apply_chat_template(self, messages: list[Message]) -> list[int]: ...

    def next_turn_ids(self, history_ids: list[int], history_messages: list[Message],
                      new_messages: list[Message]) -> list[int]: ...


@dataclass
class ChatSettings:
    """Per-tab sampling settings (the settings modal edits these and the system prompt)."""

    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 512
    seed: int | None = None

    def params(self) -> SamplingParams:
        """Validated sampling params (raises ValueError on a bad value)."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_tokens=self.max_tokens, seed=self.seed)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ChatSettings:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TurnStats:
    """Numbers of the last turn, for the status line."""

    ttft_s: float | None = None
    tokens_per_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


class ContextOverflow(ValueError):
    """The prompt does not fit in the context."""

    def __init__(self, prompt_tokens: int, context: int) -> None:
        super().__init__(f"The prompt is {prompt_tokens} tokens; the context holds {context} "
                         f"(answer included).")
        self.prompt_tokens = prompt_tokens
        self.context = context


@dataclass
class ChatSession:
    """The state of one conversation tab, saved in `History` as it changes."""

    history: History
    conv_id: int
    title: str = "New chat"
    model: str = ""
    system_prompt: str = ""
    settings: ChatSettings = field(default_factory=ChatSettings)
    messages: list[StoredMessage] = field(default_factory=list)
    ids: list[int] | None = None  # exact ids of the conversation after the last complete turn
    stats: TurnStats = field(default_factory=TurnStats)
    request_id: str | None = None  # set while an answer streams
    thinks: bool = False  # the model thinks before it answers (its template knows <think>)
    thinking_opened: bool = False  # the last prompt opened the thinking block itself
    _turn_start_ids: list[int] | None = None  # `ids` before the last turn's user message
    _last_prompt_ids: list[int] | None = None

    @classmethod
    def new(cls, history: History, model: str = "", **kw: Any) -> ChatSession:
        settings = kw.pop("settings", ChatSettings())
        conv_id = history.create(model=model, settings=settings.to_dict(), **kw)
        return cls(history, conv_id, model=model, settings=settings, **kw)

    @classmethod
    def from_conversation(cls, history: History, conv: Conversation,
                          model: str | None) -> ChatSession:
        """A session for a saved conversation; its token ids are kept if the model is the same
        (or not known yet: `set_model` decides once it is loaded)."""
        if model is None:
            model = conv.model
        ids = conv.token_ids if conv.model == model else None
        if conv.model != model:
            history.update_conversation(conv.id, model=model, token_ids=None)
        return cls(history, conv.id, title=conv.title, model=model,
                   system_prompt=conv.system_prompt,
                   settings=ChatSettings.from_dict(conv.settings), messages=list(conv.messages),
                   ids=ids)

    @property
    def busy(self) -> bool:
        return self.request_id is not None

    def chat_messages(self, messages: list[StoredMessage] | None = None) -> list[Message]:
        """The conversation as chat messages (system prompt first). A saved chat's tool calls
        and results (from the API) are shown, not sent: the chat app gives the model no tools,
        so an answer that was only calls is left out with them."""
        msgs: list[Message] = []
        if self.system_prompt:
            msgs.append({"role": "system", "content": self.system_prompt})
        msgs += [{"role": m.role, "content": m.content} for m in (messages or self.messages)
                 if m.role == "user" or (m.role == "assistant"
                                         and (m.content or not m.tool_calls))]
        return msgs

    # editing
    def add_user(self, text: str) -> StoredMessage:
        """Append a user message (saved now); the title comes from the first one."""
        if not text.strip():
            raise ValueError("empty message")
        self._turn_start_ids = self.ids
        self._last_prompt_ids = None
        msg = StoredMessage(self.history.add_message(self.conv_id, "user", text), "user", text)
        self.messages.append(msg)
        if self.title == "New chat":
            self.set_title(" ".join(text.split())[:40])
        return msg

    def set_title(self, title: str) -> None:
        self.title = title.strip() or "Untitled"
        self.history.rename(self.conv_id, self.title)

    def set_model(self, model: str) -> None:
        """A new model: its tokens differ, so the exact ids start over."""
        if model == self.model:
            return
        self.model = model
        self._reset_ids()
        self.history.update_conversation(self.conv_id, model=model)

    def configure(self, system_prompt: str, settings: ChatSettings) -> None:
        settings.params()  # validate
        if system_prompt != self.system_prompt:
            self._reset_ids()
        self.system_prompt = system_prompt
        self.settings = settings
        self.history.update_conversation(self.conv_id, system_prompt=system_prompt,
                                         settings=settings.to_dict())

    def drop_last_answer(self) -> bool:
        """Remove the last assistant message (for regenerate); False if there is none."""
        if not self.messages or self.messages[-1].role != "assistant":
            return False
        self.history.delete_messages([self.messages.pop().id])
        self.ids = self._turn_start_ids
        return True

    def pop_last_user(self) -> str | None:
        """Remove the last turn (user message and its answer) and return the user's text."""
        idx = next((i for i in range(len(self.messages) - 1, -1, -1)
                    if self.messages[i].role == "user"), None)
        if idx is None:
            return None
        removed = self.messages[idx:]
        del self.messages[idx:]
        self.history.delete_messages([m.id for m in removed])
        self.ids = self._turn_start_ids
        self._turn_start_ids = self._last_prompt_ids = None
        self._save_ids()
        return removed[0].content

    def drop_oldest_turn(self) -> bool:
        """Remove the oldest user/assistant pair, keeping the last user message."""
        users = [i for i, m in enumerate(self.messages) if m.role == "user"]
        if len(users) < 2:
            return False
        removed = self.messages[: users[1]]
        del self.messages[: users[1]]
        self.history.delete_messages([m.id for m in removed])
        self._reset_ids()
        return True

    def clear(self) -> None:
        self.messages.clear()
        self.history.clear(self.conv_id)
        self._reset_ids()
        self.stats = TurnStats()

    def _reset_ids(self) -> None:
        self.ids = self._turn_start_ids = self._last_prompt_ids = None
        self._save_ids()

    def _save_ids(self) -> None:
        self.history.update_conversation(self.conv_id, token_ids=self.ids)

    # the turn
    def prompt_ids(self, tokenizer: TurnTokenizer) -> list[int]:
        """Token ids of the prompt answering the last user message (exact turn when possible)."""
        if self._last_prompt_ids is not None:
            return self._last_prompt_ids
        msgs = self.chat_messages()
        if self.ids is not None and len(msgs) >= 2 and msgs[-1]["role"] == "user":
            ids = tokenizer.next_turn_ids(self.ids, msgs[:-1], msgs[-1:])
        else:
            ids = tokenizer.apply_chat_template(msgs)
        self._last_prompt_ids = list(ids)
        return self._last_prompt_ids

    async def stream_turn(self, client: EngineClient, tokenizer: TurnTokenizer | None,
                          max_model_len: int = 0) -> AsyncIterator[StreamDelta]:
        """Answer the last user message: yields the deltas; saves the answer as it streams.

        Raises ContextOverflow (nothing sent) when the prompt does not fit, and ValueError
        from the client's validation."""
        params = self.settings.params()
        prompt = self.prompt_ids(tokenizer) if tokenizer is not None else None
        if prompt is not None and max_model_len and len(prompt) >= max_model_len:
            raise ContextOverflow(len(prompt), max_model_len)
        request_id = f"tab{self.conv_id}-{uuid.uuid4().hex[:8]}"
        session_id = f"conv-{self.conv_id}"
        self.thinks, self.thinking_opened = thinking_of(tokenizer, self.chat_messages())
        if prompt is not None:
            stream = client.generate(prompt, params, request_id=request_id, session_id=session_id)
        else:
            stream = client.chat(self.chat_messages(), params, request_id=request_id,
                                 session_id=session_id)
        # where the template opened the thinking block, the answer keeps the tag too (the
        # saved chat shows and re-renders it as the model's whole answer)
        start_text = OPEN + "\n" if self.thinking_opened else ""
        answer = StoredMessage(self.history.add_message(self.conv_id, "assistant", start_text,
                                                        "streaming"),
                               "assistant", start_text, "streaming")
        self.messages.append(answer)
        self.request_id = request_id
        self.stats = TurnStats()
        out_ids: list[int] = []
        start = last_save = time.perf_counter()
        first_at: float | None = None
        status = "error"
        iterator = aiter(stream)
        try:
            first: StreamDelta | None = await anext(iterator)
        except StopAsyncIteration:
            first = None
        except Exception:  # refused before anything streamed: no answer to keep
            self.messages.remove(answer)
            self.history.delete_messages([answer.id])
            self.request_id = None
            raise

        async def deltas() -> AsyncIterator[StreamDelta]:
            if first is not None:
                yield first
            async for d in iterator:
                yield d

        try:
            async for delta in deltas():
                now = time.perf_counter()
                if first_at is None and (delta.text or delta.token_ids):
                    first_at = now
                    self.stats.ttft_s = now - start
                answer.content += delta.text
                out_ids += delta.token_ids
                self._count(delta, len(prompt) if prompt else 0, len(out_ids), first_at, now)
                if delta.finished:
                    status = {"stop": "done", "length": "done", "abort": "stopped"}.get(
                        delta.finish_reason or "", "error")
                    if status == "error" and delta.error:
                        answer.content += f"\n\n**Error:** {delta.error}"
                elif now - last_save >= SAVE_EVERY_S:
                    self.history.update_message(answer.id, answer.content)
                    last_save = now
                yield delta
                if delta.finished:
                    break
            else:
                status = "stopped"
        except BaseException:
            status = "stopped"
            raise
        finally:
            if status == "stopped" and hasattr(iterator, "aclose"):
                await iterator.aclose()  # leaving the stream early aborts the request
            self.request_id = None
            answer.status = status
            self.history.update_message(answer.id, answer.content, status)
            if status == "done" and prompt is not None:
                self.ids = prompt + out_ids
            else:
                self.ids = None  # a cut answer has no end-of-turn: rebuild from the template
            self._last_prompt_ids = prompt  # regenerate sends exactly the same prompt
            self._save_ids()

    def _count(self, d: StreamDelta, n_prompt: int, n_out: int, first_at: float | None,
               now: float) -> None:
        s = self.stats
        s.prompt_tokens = d.num_prompt_tokens or s.prompt_tokens or n_prompt
        s.cached_tokens = max(s.cached_tokens, d.num_cached_tokens)
        s.output_tokens = max(d.num_output_tokens, n_out, s.output_tokens)
        if first_at is not None and now > first_at and s.output_tokens > 1:
            s.tokens_per_s = (s.output_tokens - 1) / (now - first_at)
