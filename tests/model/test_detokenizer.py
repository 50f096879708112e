"""IncrementalDetokenizer: streamed deltas add up to the full decode, and never hold a
partial UTF-8 character."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localpaged.model.detokenizer import IncrementalDetokenizer
from localpaged.model.tokenizer import Tokenizer

PIECES = [*"ab cdé\n,.中文🙂✨—", "the", " fox", "def "]
TEXT = st.lists(st.sampled_from(PIECES), max_size=20).map("".join)


@pytest.fixture(scope="module", params=["qwen", "mistral"])
def tok(request: pytest.FixtureRequest, hf_tokenizers) -> Tokenizer:
    return Tokenizer(hf_tokenizers[request.param])


def _stream(tok: Tokenizer, ids: list[int], chunks: list[int], skip: bool) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas, i = [], 0
    for n in [*chunks, len(ids)]:
        deltas.append(detok.add(ids[i : i + max(n, 1)]))
        i += max(n, 1)
        if i >= len(ids):
            break
    assert detok.text == "".join(deltas)
    return deltas, detok.flush()


def _check(tok: Tokenizer, ids: list[int], chunks: list[int], skip: bool) -> None:
    full = tok.decode(ids, skip_special_tokens=skip)
    deltas, rest = _stream(tok, ids, chunks, skip)
    assert "".join(deltas) + rest == full  # flush emits what was held back
    if "\ufffd" not in full:  # decodes cleanly
        assert rest == ""
        assert "".join(deltas) == full
        assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_random_ids(tok: Tokenizer, data: st.DataObject, skip: bool) -> None:
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), min_size=1, max_size=40))
    chunks = data.draw(st.lists(st.integers(1, 3), max_size=40))
    _check(tok, ids, chunks, skip)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), text=TEXT.filter(bool))
def test_text_split_into_bytes(tok: Tokenizer, data: st.DataObject, text: str) -> None:
    """Multi-byte characters spread over several tokens: each comes out whole, once."""
    ids = [i for ch in text for i in tok.encode(ch)] if data.draw(st.booleans()) \
        else tok.encode(text)
    eos = tok.eos_token_ids[0]
    half = len(ids) // 2
    ids = [*ids[:half], eos, *ids[half:]]
    chunks = data.draw(st.lists(st.integers(1, 2), max_size=60))
    _check(tok, ids, chunks, skip=True)
    _check(tok, ids, chunks, skip=False)


def test_emoji_waits_for_its_last_byte(hf_tokenizers) -> None:
    tok = Tokenizer(hf_tokenizers["qwen"])
    ids = tok.encode("ok🚀")
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add([i]) for i in ids]
    assert deltas[-1] == "🚀" and "".join(deltas) == "ok🚀"
    assert all(d == "" for d in deltas[2:-1])  # the emoji's leading bytes emit nothing


def test_context_ids_give_leading_space(hf_tokenizers) -> None:
    """With SentencePiece-style spaces, a first answer token decoded alone loses its space;
    the prompt's last tokens as context keep it, without emitting the prompt."""
    tok = Tokenizer(hf_tokenizers["mistral"])
    ids = tok.encode("[INST] Hi [/INST] It is 4")
    cut = len(tok.encode("[INST] Hi [/INST]"))
    detok = IncrementalDetokenizer(tok, context_ids=ids[:cut])
    text = "".join(detok.add([i]) for i in ids[cut:])
    assert text == tok.decode(ids)[len(tok.decode(ids[:cut])) :]
    assert text.startswith(" ")


@pytest.mark.smollm
@settings(max_examples=40, deadline=None)
@given(data=st.data(), text=TEXT)
def test_smollm_detokenizer(smollm_hf_dir: Path, data: st.DataObject, text: str) -> None:
    tok = _smollm(smollm_hf_dir)
    ids = tok.encode(text) + data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=12))
    chunks = data.draw(st.lists(st.integers(1, 3), max_size=60))
    _check(tok, ids, chunks, skip=True)


_SMOLLM: dict[Path, Tokenizer] = {}


def _smollm(folder: Path) -> Tokenizer:
    if folder not in _SMOLLM:
        _SMOLLM[folder] = Tokenizer.from_pretrained(folder)
    return _SMOLLM[folder]
