"""Tokenizer: a transformers fast tokenizer plus what the engine needs around it: all eos
ids, the chat template, exact multi-turn prompts (DESIGN.md "Exact turns") and FIM prompts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

Message = dict[str, Any]

# Used when the tokenizer ships no chat template: plain "Role: text" turns.
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

# What AutoTokenizer reads of an HF folder: a change to any of them makes a new cache entry.
HF_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "config.json", "tokenizer.model", "vocab.json",
    "merges.txt",
)
HF_TOKENIZER_CACHE_VERSION = 2  # 2: compact tokenizer.json

# (prefix, suffix, middle) token spellings, tried in order.
FIM_STYLES = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SmolLM
)


def _token_ids(hf_tokenizer: Any, tokens: Iterable[str]) -> tuple[int | None, ...]:
    """Each token's id, None where the vocabulary lacks it: asked of the `tokenizers` backend
    where there is one (the whole vocabulary as a dict costs 0.05 s of a load)."""
    backend = getattr(hf_tokenizer, "backend", None) or getattr(hf_tokenizer, "_tokenizer", None)
    if hasattr(backend, "token_to_id"):
        return tuple(backend.token_to_id(t) for t in tokens)
    vocab = hf_tokenizer.get_vocab()
    return tuple(vocab.get(t) for t in tokens)


class Tokenizer:
    """Text <-> token ids for one model. Wraps an HF fast tokenizer or a `SavedTokenizer`
    (`hf`)."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Iterable[int] = ()) -> None:
        self.hf = hf_tokenizer
        eos = [hf_tokenizer.eos_token_id] if hf_tokenizer.eos_token_id is not None else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos, *eos_token_ids]))
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.vocab_size: int = len(hf_tokenizer)
        self.chat_template: str | None = getattr(hf_tokenizer, "chat_template", None) or None
        # What the template gets beside the messages (bos_token ...), as transformers hands it
        self.special_tokens: dict[str, str] = dict(getattr(hf_tokenizer, "special_tokens_map",
                                                           None) or {})
        # Whether the tokenizer's own encode puts a BOS first (then chat prompts need one).
        probe = hf_tokenizer.encode("a", add_special_tokens=True)
        self.adds_bos = self.bos_token_id is not None and probe[:1] == [self.bos_token_id]
        self._fim = next((ids for ids in (_token_ids(hf_tokenizer, style) for style in FIM_STYLES)
                          if None not in ids), None)

    @property
    def hf_full(self) -> Any:
        """The transformers tokenizer itself (for libraries that take one, e.g. xgrammar)."""
        full = getattr(type(self.hf), "full", None)
        return full(self.hf) if full is not None else self.hf

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> Tokenizer:
        """Load `folder`'s tokenizer (`hf_folder_tokenizer`); eos ids also from
        generation_config.json and config.json."""
        folder = Path(folder)
        hf = hf_folder_tokenizer(folder)
        extra: list[int] = []
        for name in ("generation_config.json", "config.json"):
            if (folder / name).exists():
                eos = json.loads((folder / name).read_text(encoding="utf-8")).get("eos_token_id")
                extra += eos if isinstance(eos, list) else [] if eos is None else [eos]
        return cls(hf, eos_token_ids=extra)

    # -- plain text -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`, without the tokenizer's space clean-up (so streaming agrees)."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False)

    # -- chat -------------------------------------------------------------------------------

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    **template_vars: Any) -> str:
        """The chat template's text for `messages` (FALLBACK_CHAT_TEMPLATE when none);
        `template_vars` are the template's own switches (e.g. Qwen3's `enable_thinking`)."""
        template = self.chat_template or FALLBACK_CHAT_TEMPLATE
        if not isinstance(template, str):  # named templates (a dict): transformers picks
            return self.hf.apply_chat_template(
                list(messages), chat_template=None, tokenize=False,
                add_generation_prompt=add_generation_prompt, **template_vars)
        from localpaged.model import chat_template  # jinja2: imported at the first chat, not load

        return chat_template.render(template, messages, add_generation_prompt=add_generation_prompt,
                                    special_tokens=self.special_tokens, **template_vars)

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True,
        **template_vars: Any,
    ) -> list[int]:
        """Prompt ids for `messages`. A BOS is added only when the tokenizer adds one and
        the template did not already write it (never two)."""
        ids = self.encode(self.render_chat(messages, add_generation_prompt, **template_vars))
        if self.adds_bos and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def next_turn_ids(
        self,
        history_ids: Sequence[int],
        history_messages: Sequence[Message],
        new_messages: Sequence[Message],
    ) -> list[int]:
        """history_ids + the ids of what `new_messages` add to the conversation.

        history_ids are the exact tokens of the previous prompt and its generated answer (the
        answer is history_messages[-1]; its last token may be an eos). Only the text the
        template adds after the history is tokenized, so the result always starts with
        history_ids and equals apply_chat_template(history + new) whenever the answer's tokens
        re-tokenize identically.
        """
        history, new = list(history_messages), list(new_messages)
        full = self.render_chat(history + new, add_generation_prompt=True)
        if history and history[-1].get("role") == "assistant":
            covered = self.render_chat(history[:-1]) + str(history[-1].get("content") or "")
        else:
            covered = self.render_chat(history)
        # Where the history ends in the full text (a template that is not prefix-stable, or
        # trims the answer, makes this the longest common prefix).
        start = _common_prefix_len(covered, full)
        if covered[start:].strip():
            # The template rewrote the history, not only its whitespace (a thinking model's
            # drops the thinking of past answers): its own rendering is the prompt, and the
            # prefix cache still reuses the blocks up to where the two agree.
            return self.apply_chat_template(history + new)
        if history_ids and history_ids[-1] in self._special_ids():
            # The answer ended in a special token (eos / end of turn): skip its text if the
            # template writes the same token next (after whitespace it may have trimmed).
            tok_text = self.hf.convert_ids_to_tokens(int(history_ids[-1]))
            at = full.find(tok_text, start)
            if at >= 0 and not full[start:at].strip():
                start = at + len(tok_text)
        return list(history_ids) + self._encode_continuation(full[start:])

    def _special_ids(self) -> set[int]:
        decoder = getattr(self.hf, "added_tokens_decoder", {}) or {}
        return {i for i, t in decoder.items() if getattr(t, "special", False)} | set(
            self.eos_token_ids)

    def _encode_continuation(self, text: str) -> list[int]:
        """Ids of `text` as it tokenizes in the middle of a prompt: after a special token,
        so tokenizers that prefix a space to the start of an input do not add one here."""
        if not text:
            return []
        anchor_id = self.eos_token_ids[0] if self.eos_token_ids else self.bos_token_id
        if anchor_id is not None:
            anchor = self.hf.convert_ids_to_tokens(anchor_id)
            ids = self.encode(anchor + text)
            if ids[:1] == [anchor_id]:
                return ids[1:]
        return self.encode(text)

    # -- code completion --------------------------------------------------------------------

    def fim_ids(self, prefix: str, suffix: str) -> list[int] | None:
        """Fill-in-the-middle prompt (prefix-suffix-middle order) when the vocabulary has FIM
        tokens, else None."""
        if self._fim is None:
            return None
        pre, suf, mid = self._fim
        bos = [self.bos_token_id] if self.adds_bos else []
        return [*bos, pre, *self.encode(prefix), suf, *self.encode(suffix), mid]


def hf_folder_tokenizer(folder: Path) -> Any:
    """The tokenizer AutoTokenizer builds for the HF folder, saved in the cache on the first
    load and answered from there after (a `SavedTokenizer`: usable at once, transformers
    imported beside it). The saved copy, not the folder's tokenizer.json, is what the fast path
    reads: transformers' model-specific classes rebuild parts of that pipeline (a Llama
    tokenizer's pre-tokenizer and byte fallback), and the copy holds the result. A folder
    without tokenizer.json (only a sentencepiece tokenizer.model, say) is left to
    AutoTokenizer every time."""
    from localpaged.model.saved_tokenizer import open_saved, save_tokenizer, tokenizer_cache_dir

    cached = None
    if (folder / "tokenizer.json").is_file():
        cached = tokenizer_cache_dir("hf") / _hf_folder_key(folder)
        saved = open_saved(cached)
        if saved is not None:
            return saved
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    if cached is not None:
        save_tokenizer(hf, cached)
    return hf


def _hf_folder_key(folder: Path) -> str:
    """Cache key of `folder`'s tokenizer: its path, its tokenizer files' sizes and mtimes, and
    the transformers version (which decides what AutoTokenizer builds)."""
    from importlib.metadata import version

    parts = [str(folder.resolve()), version("transformers"), str(HF_TOKENIZER_CACHE_VERSION)]
    for name in HF_TOKENIZER_FILES:
        try:
            st = (folder / name).stat()
        except OSError:
            continue
        parts.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
