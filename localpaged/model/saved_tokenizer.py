"""A saved HF tokenizer (tokenizer.json + tokenizer_config.json) usable without transformers.

Importing transformers takes a second or two (it scans its model folders) and ~100 MiB,
longer than mapping a cached model's weights. `SavedTokenizer` answers what needs only the
`tokenizers` backend (encode, decode, the vocabulary, special tokens, the chat template's
text and variables: `localpaged.model.chat_template` renders it) and builds the transformers
tokenizer for the rest (xgrammar's constrained output) when that is first asked for.

Tokenizers are saved for this under `tokenizer_cache_dir(kind)`: those converted from GGUF
metadata (`localpaged.model.gguf_loader`) and those transformers built for an HF folder
(`localpaged.model.tokenizer`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

# The special tokens a tokenizer hands its template, by their tokenizer_config.json keys.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                      "cls_token", "mask_token")


def special_tokens_of(config: Mapping[str, Any]) -> dict[str, str]:
    """The special tokens (`SPECIAL_TOKEN_KEYS`) a tokenizer_config.json names, as strings."""
    out = {}
    for key in SPECIAL_TOKEN_KEYS:
        token = config.get(key)
        if isinstance(token, Mapping):
            token = token.get("content")
        if isinstance(token, str):
            out[key] = token
    return out


class SavedTokenizer:
    """The HF tokenizer saved in `folder`, the transformers object made by `load_full`."""

    def __init__(self, folder: Path, load_full: Callable[[], Any]) -> None:
        from tokenizers import Tokenizer as Backend

        self.backend = Backend.from_file(str(folder / "tokenizer.json"))
        with open(folder / "tokenizer_config.json", encoding="utf-8") as f:
            config = json.load(f)
        template = config.get("chat_template")
        jinja = folder / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.special_tokens_map = special_tokens_of(config)  # what templates get as variables
        self.eos_token_id = self._special_id(self.special_tokens_map.get("eos_token"))
        self.bos_token_id = self._special_id(self.special_tokens_map.get("bos_token"))
        self.added_tokens_decoder = self.backend.get_added_tokens_decoder()
        # transformers sets this on its backend at every load; tokenizer.json does not keep it
        self.backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        self._load_full = load_full
        self._full: Any = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._started = False
        self._start_lock = threading.Lock()

    def start_background(self) -> None:
        """Start building the transformers tokenizer on a thread of its own (once). Not
        started by default: its import of transformers is 2-3 s of Python and ~100 MiB that
        chats and token-id prompts never need, and beside the first steps it took a core
        from the kernels."""
        with self._start_lock:
            if self._started:
                return
            self._started = True
        # A daemon: a process that never needs the full tokenizer does not wait for it to exit.
        threading.Thread(target=self._build, name="localpaged-tokenizer", daemon=True).start()

    def _special_id(self, token: str | None) -> int | None:
        return self.backend.token_to_id(token) if token is not None else None

    def _build(self) -> None:
        try:
            self._full = self._load_full()
        except BaseException as exc:  # raised to whoever asks for it
            self._error = exc
        finally:
            self._ready.set()

    def wait_ready(self) -> None:
        """Wait for a started background build to end (its error, if any, stays for `full`)."""
        if self._started:
            self._ready.wait()

    def full(self) -> Any:
        """The transformers tokenizer (built now if nobody started it; else waits for it)."""
        self.start_background()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self._full

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool = False) -> str:
        if clean_up_tokenization_spaces:
            return self.full().decode(list(ids), skip_special_tokens=skip_special_tokens,
                                      clean_up_tokenization_spaces=True)
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str | None] | None:
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(int(i)) for i in ids]

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        return self.full().apply_chat_template(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # the rest of the HF interface
        if name.startswith("_") or name in ("backend", "full"):
            raise AttributeError(name)
        return getattr(self.full(), name)


TOKENIZER_CACHE_KEEP = 32  # saved tokenizers kept per kind (a few MiB each)


def tokenizer_cache_dir(kind: str) -> Path:
    """Where saved tokenizers of `kind` are kept: "gguf", converted from GGUF metadata
    (converting a 49k-token BPE vocabulary takes seconds, loading the saved tokenizer.json well
    under one); "hf", as transformers built an HF folder's."""
    env = os.environ.get("LOCALPAGED_HOME")
    if env:
        return Path(env).expanduser() / "cache" / f"{kind}-tokenizers"
    import platformdirs

    return Path(platformdirs.user_cache_dir("localpaged")) / f"{kind}-tokenizers"


def load_saved(folder: Path) -> Any:
    """The transformers tokenizer saved by `save_tokenizer`, through the class it names:
    AutoTokenizer finds the same class but first imports and probes much more of transformers
    (about half a second of a load)."""
    import transformers

    with open(folder / "tokenizer_config.json", encoding="utf-8") as f:
        name = json.load(f).get("tokenizer_class")
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if cls is None or not name.endswith(("Tokenizer", "TokenizerFast")):
        from transformers import AutoTokenizer

        cls = AutoTokenizer
    return cls.from_pretrained(str(folder))


def save_tokenizer(tok: Any, folder: Path) -> None:
    """Save atomically (a temp folder renamed into place); a failure only skips the cache.
    The cache keeps the `TOKENIZER_CACHE_KEEP` most recently used entries of its kind."""
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(tmp))
        if (tmp / "tokenizer.json").is_file():
            compact_tokenizer_json(tmp / "tokenizer.json")
        os.replace(tmp, folder)
        _keep_recent(folder.parent, TOKENIZER_CACHE_KEEP)
    except OSError:
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def compact_tokenizer_json(path: Path) -> None:
    """Rewrite a saved tokenizer.json in the form `tokenizers` reads fastest: a BPE model's
    merges as "a b" strings rather than pairs (where no part holds a space: only then do the
    two forms mean the same), no indentation. A 49k-token vocabulary then loads in ~42 ms
    instead of ~63, and every model load waits on it."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    model = data.get("model")
    merges = model.get("merges") if isinstance(model, dict) else None
    if (model.get("type") == "BPE" and isinstance(merges, list)
            and all(isinstance(m, list) and len(m) == 2 and " " not in m[0] + m[1]
                    for m in merges)):
        model["merges"] = [f"{a} {b}" for a, b in merges]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, separators=(",", ":"))


def _keep_recent(cache: Path, keep: int) -> None:
    """Remove all but the `keep` most recently used entries (by their folder's time, which
    `open_saved` refreshes): each file or folder of a model ever loaded has one, and moved or
    deleted ones (and a test suite's temporary folders) would otherwise pile up."""
    entries = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")]
    entries.sort(key=lambda p: p.stat().st_mtime_ns, reverse=True)
    for old in entries[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def open_saved(folder: Path) -> SavedTokenizer | None:
    """A `SavedTokenizer` of the tokenizer `save_tokenizer` left in `folder` (its transformers
    object by `load_saved`), or None when none is there. One that cannot be read is removed,
    so that the caller's `save_tokenizer` can put a good one in its place."""
    if not (folder / "tokenizer.json").is_file():
        return None
    try:
        saved = SavedTokenizer(folder, lambda: load_saved(folder))
    except Exception:
        shutil.rmtree(folder, ignore_errors=True)
        return None
    with contextlib.suppress(OSError):
        os.utime(folder)  # used now: the cache keeps the most recently used
    return saved
