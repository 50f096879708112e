"""Tokenizer: chat template vs transformers, exact next turns, FIM prompts; on small
tokenizers trained here and on the real SmolLM2 tokenizer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localpaged.model.saved_tokenizer import SavedTokenizer, compact_tokenizer_json
from localpaged.model.tokenizer import FALLBACK_CHAT_TEMPLATE, Tokenizer

CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
TEXT = st.text(alphabet="abcdefgh ,.?!\n12éü中🙂", min_size=1, max_size=30)
ASCII_TEXT = st.text(alphabet="abcdefgh ,.?!12", min_size=1, max_size=30).filter(str.strip)


def _hf_ids(tok: Tokenizer, messages: list[dict], template: str | None = None) -> list[int]:
    return list(tok.hf.apply_chat_template(
        messages, chat_template=template, tokenize=True, add_generation_prompt=True,
        return_dict=False))


@pytest.fixture(autouse=True)
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cache of HF folders' tokenizers, in a temp dir."""
    monkeypatch.setenv("LOCALPAGED_HOME", str(tmp_path / "home"))
    return tmp_path / "home" / "cache" / "hf-tokenizers"


@pytest.fixture(scope="module")
def qwen(hf_tokenizers) -> Tokenizer:
    return Tokenizer(hf_tokenizers["qwen"], eos_token_ids=[0, 2])


@pytest.fixture(scope="module")
def mistral(hf_tokenizers) -> Tokenizer:
    return Tokenizer(hf_tokenizers["mistral"])


@pytest.fixture(scope="module")
def starcoder(hf_tokenizers) -> Tokenizer:
    return Tokenizer(hf_tokenizers["starcoder"])


def test_members(qwen: Tokenizer, mistral: Tokenizer) -> None:
    im_end = qwen.hf.convert_tokens_to_ids("<|im_end|>")
    assert qwen.eos_token_ids == (im_end, 0)  # tokenizer's eos first, no duplicates
    assert qwen.bos_token_id is None and not qwen.adds_bos
    assert qwen.vocab_size == len(qwen.hf) and qwen.chat_template
    assert mistral.adds_bos and mistral.bos_token_id == 1
    text = "Hello, how are you?"
    assert qwen.decode(qwen.encode(text)) == text
    assert mistral.encode(text, add_special_tokens=True)[0] == 1


@pytest.mark.parametrize("name", ["qwen", "mistral"])
def test_chat_template_matches_transformers(name: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(name)
    messages = CHAT[1:] if name == "mistral" else CHAT
    ids = tok.apply_chat_template(messages)
    assert ids == _hf_ids(tok, messages)
    assert ids.count(1) <= 1 or name != "mistral"  # the template's BOS, not a second one
    assert tok.render_chat(messages).endswith("<|im_start|>assistant\n" if name == "qwen"
                                              else "[/INST]")


def test_fallback_template(starcoder: Tokenizer) -> None:
    assert starcoder.chat_template is None
    text = starcoder.render_chat(CHAT)
    assert text == ("System: You are a helpful assistant.\n\n"
                    "User: What is the capital of France?\n\nAssistant:")
    assert starcoder.apply_chat_template(CHAT) == _hf_ids(starcoder, CHAT, FALLBACK_CHAT_TEMPLATE)


def _check_next_turn(tok: Tokenizer, answer: str, question: str, eos: bool) -> None:
    """Turn 1 prompt + answer ids, then turn 2 through next_turn_ids. The answer's ids are
    tried two ways: as encoding its text alone gives them (may differ from how the template
    text tokenizes) and as the rendered conversation tokenizes them."""
    history = [CHAT[1]]
    prompt = tok.apply_chat_template(history)
    history.append({"role": "assistant", "content": answer})
    new = [{"role": "user", "content": question}]
    expected = tok.apply_chat_template(history + new)
    eos_ids = [tok.eos_token_ids[0]] if eos else []
    rendered = tok.apply_chat_template(history, add_generation_prompt=False)
    n_answer = len(tok.encode(answer))
    for answer_ids in (tok.encode(answer), rendered[len(prompt) : len(prompt) + n_answer]):
        history_ids = prompt + answer_ids + eos_ids
        got = tok.next_turn_ids(history_ids, history, new)
        assert got[: len(history_ids)] == history_ids
        n_new = len(got) - len(history_ids)
        assert n_new > 0 and got[len(history_ids) :] == expected[-n_new:]
        if expected[: len(history_ids)] == history_ids:  # the answer re-tokenizes identically
            assert got == expected


@settings(max_examples=60, deadline=None)
@given(answer=TEXT, question=TEXT, eos=st.booleans())
def test_next_turn_property_chatml(qwen: Tokenizer, answer: str, question: str,
                                   eos: bool) -> None:
    _check_next_turn(qwen, answer, question, eos)


@settings(max_examples=60, deadline=None)
@given(answer=ASCII_TEXT, question=ASCII_TEXT)
def test_next_turn_property_sentencepiece(mistral: Tokenizer, answer: str,
                                          question: str) -> None:
    """Tokenizers that put a space before an input's first word: the new part is encoded as
    it tokenizes mid-prompt (after the eos), not as a fresh input."""
    _check_next_turn(mistral, answer.strip(), question.strip(), eos=True)


def test_next_turn_chain_keeps_every_prefix(qwen: Tokenizer) -> None:
    """Three turns: each prompt extends the previous prompt + answer exactly, even when the
    answer's ids are not the ones re-tokenizing its text would give."""
    messages = [CHAT[1]]
    ids = qwen.apply_chat_template(messages)
    for turn, answer in enumerate(["Paris.", "It is 🙂 big!", "Yes"]):
        odd_ids = [i for ch in answer for i in qwen.encode(ch)]  # one character at a time
        assert turn == 2 or odd_ids != qwen.encode(answer)
        history_ids = ids + odd_ids + [qwen.eos_token_ids[0]]
        messages.append({"role": "assistant", "content": answer})
        new = [{"role": "user", "content": f"question {turn}"}]
        ids = qwen.next_turn_ids(history_ids, messages, new)
        messages += new
        assert ids[: len(history_ids)] == history_ids
        assert qwen.decode(ids, False) == qwen.render_chat(messages)


TRIM_TEMPLATE = (  # Llama 3 style: contents are trimmed, each turn ends in the eos
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n\n' + m['content'] | trim"
    " + '<|im_end|>' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n\n' }}{% endif %}"
)


def test_next_turn_with_trimming_template(hf_tokenizers) -> None:
    """The answer's trailing whitespace is trimmed by the template: its eos is still not
    written twice."""
    tok = Tokenizer(hf_tokenizers["qwen"])
    tok.chat_template = TRIM_TEMPLATE
    history = [CHAT[1]]
    history_ids = tok.apply_chat_template(history) + tok.encode("Paris.\n") + [
        tok.eos_token_ids[0]]
    history.append({"role": "assistant", "content": "Paris.\n"})
    new = [{"role": "user", "content": "Thanks"}]
    got = tok.next_turn_ids(history_ids, history, new)
    assert got[: len(history_ids)] == history_ids
    assert tok.decode(got[len(history_ids) :], False) == (
        "<|im_start|>user\n\nThanks<|im_end|><|im_start|>assistant\n\n")


def test_eos_ids_from_folder(hf_tokenizers, tmp_path: Path) -> None:
    """eos ids: the tokenizer's, then generation_config.json's list, then config.json's."""
    hf_tokenizers["qwen"].save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [5, 2]}')
    (tmp_path / "config.json").write_text('{"eos_token_id": 7}')
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.eos_token_ids == (2, 5, 7)
    assert tok.apply_chat_template(CHAT) == Tokenizer(hf_tokenizers["qwen"]).apply_chat_template(
        CHAT)


def _hf_folder(hf_tokenizers, kind: str, folder: Path, tokenizer_class: str | None = None) -> Path:
    """The `kind` test tokenizer saved as an HF folder, its class renamed to `tokenizer_class`,
    with a generation_config.json naming more eos ids."""
    hf_tokenizers[kind].save_pretrained(folder)
    if tokenizer_class:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(
            json.dumps({**config, "tokenizer_class": tokenizer_class}))
    (folder / "generation_config.json").write_text('{"eos_token_id": [5, 2]}')
    return folder


FOLDER_TEXTS = ["Hello, how are you?", "  two  spaces\tand\ttabs\n\nnewlines ", "",
                "<|im_start|>user\nhi<|im_end|>\n", "<s>[INST] hi [/INST] ok</s>",
                "Café 中文 🙂 naïve", "def f(x):\n    return x ** 2"]


# "LlamaTokenizerFast": transformers rebuilds the pipeline of tokenizer.json (byte fallback,
# a Metaspace pre-tokenizer), so the folder's tokenizer.json alone tokenizes differently.
@pytest.mark.parametrize(("kind", "tokenizer_class"),
                         [("qwen", None), ("mistral", "LlamaTokenizerFast")])
def test_hf_folder_loads_through_saved_tokenizer(hf_tokenizers, tmp_path: Path, hf_cache: Path,
                                                 kind: str, tokenizer_class: str | None) -> None:
    """The first load is AutoTokenizer's and saves it; later loads are SavedTokenizers of the
    saved copy, and answer exactly as AutoTokenizer on the folder."""
    import random

    from tokenizers import Tokenizer as Backend
    from transformers import AutoTokenizer

    folder = _hf_folder(hf_tokenizers, kind, tmp_path / "model", tokenizer_class)
    ref_hf = AutoTokenizer.from_pretrained(folder)
    ref = Tokenizer(ref_hf, eos_token_ids=[5, 2])  # what from_pretrained built before the cache
    first = Tokenizer.from_pretrained(folder)
    assert not isinstance(first.hf, SavedTokenizer) and len(list(hf_cache.iterdir())) == 1
    tok = Tokenizer.from_pretrained(folder)
    assert isinstance(tok.hf, SavedTokenizer)
    (saved,) = hf_cache.iterdir()  # kept compact: merges as strings, what loads fastest
    merges = json.loads((saved / "tokenizer.json").read_text(encoding="utf-8"))["model"]["merges"]
    assert merges and all(isinstance(m, str) for m in merges)
    assert (tok.eos_token_ids, tok.bos_token_id, tok.adds_bos, tok.vocab_size, tok.chat_template,
            tok._fim) == (ref.eos_token_ids, ref.bos_token_id, ref.adds_bos, ref.vocab_size,
                          ref.chat_template, ref._fim)
    for text in FOLDER_TEXTS:
        for special in (True, False):
            assert tok.encode(text, special) == ref_hf.encode(
                text, add_special_tokens=special), (text, special)
    raw = Backend.from_file(str(folder / "tokenizer.json"))
    assert (tokenizer_class is not None) == any(
        raw.encode(t, add_special_tokens=False).ids != ref_hf.encode(t, add_special_tokens=False)
        for t in FOLDER_TEXTS)
    rng = random.Random(0)
    specials = sorted(ref_hf.all_special_ids)
    for _ in range(30):
        ids = [rng.randrange(len(ref_hf)) for _ in range(rng.randrange(1, 20))]
        ids[rng.randrange(len(ids))] = rng.choice(specials)
        for skip in (True, False):
            assert tok.decode(ids, skip) == ref.decode(ids, skip)
    messages = CHAT if kind == "qwen" else CHAT[1:]
    assert tok.render_chat(messages) == ref.render_chat(messages)
    assert tok.apply_chat_template(messages) == ref.apply_chat_template(messages)
    assert type(tok.hf_full) is type(ref_hf)


def test_compacting_keeps_merges_whose_parts_hold_a_space_as_pairs(tmp_path: Path) -> None:
    """"a b" would split such a merge at the wrong space: those merges stay pairs, and the
    compacted file tokenizes as the original."""
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import BPE

    vocab = {"a": 0, " ": 1, "b": 2, "a ": 3, "a b": 4, "ab": 5}
    for merges in ([("a", " "), ("a ", "b")], [("a", "b")]):
        path = tmp_path / "tokenizer.json"
        Backend(BPE(vocab, merges)).save(str(path))
        compact_tokenizer_json(path)
        kept = json.loads(path.read_text(encoding="utf-8"))["model"]["merges"]
        assert kept == ([list(m) for m in merges] if len(merges) == 2 else ["a b"])
        for text in ("a b", "ab", "a a b"):
            assert (Backend.from_file(str(path)).encode(text).ids
                    == Backend(BPE(vocab, merges)).encode(text).ids)


def test_hf_folder_without_tokenizer_json(hf_tokenizers, tmp_path: Path, hf_cache: Path) -> None:
    """Only vocab.json and merges.txt: AutoTokenizer's own tokenizer, nothing cached."""
    qwen = hf_tokenizers["qwen"]
    qwen.backend_tokenizer.model.save(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|im_end|>", "bos_token": None}))
    for _ in range(2):
        tok = Tokenizer.from_pretrained(tmp_path)
        assert not isinstance(tok.hf, SavedTokenizer) and not hf_cache.exists()
    assert tok.eos_token_ids == (qwen.convert_tokens_to_ids("<|im_end|>"),)
    assert tok.encode(FOLDER_TEXTS[0]) == qwen.encode(FOLDER_TEXTS[0])


def test_hf_folder_damaged_cache(hf_tokenizers, tmp_path: Path, hf_cache: Path) -> None:
    """A cache entry that cannot be read: AutoTokenizer's tokenizer, and the entry saved anew."""
    folder = _hf_folder(hf_tokenizers, "qwen", tmp_path / "model")
    Tokenizer.from_pretrained(folder)
    [entry] = hf_cache.iterdir()
    (entry / "tokenizer.json").write_text("{")
    tok = Tokenizer.from_pretrained(folder)
    assert not isinstance(tok.hf, SavedTokenizer)
    again = Tokenizer.from_pretrained(folder)
    assert isinstance(again.hf, SavedTokenizer)
    assert again.encode(FOLDER_TEXTS[0]) == tok.encode(FOLDER_TEXTS[0])


def test_hf_tokenizer_cache_keeps_the_most_recently_used(
        hf_tokenizers, tmp_path: Path, hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three folders through a cache that keeps two: the one used least recently is removed,
    and using an entry (not only saving it) counts."""
    from localpaged.model import saved_tokenizer

    monkeypatch.setattr(saved_tokenizer, "TOKENIZER_CACHE_KEEP", 2)
    folders = [_hf_folder(hf_tokenizers, "qwen", tmp_path / f"model{i}") for i in range(3)]
    Tokenizer.from_pretrained(folders[0])
    [first] = hf_cache.iterdir()
    Tokenizer.from_pretrained(folders[1])
    [second] = set(hf_cache.iterdir()) - {first}
    past = second.stat().st_mtime_ns - 10**9  # clear of the file system's clock ticks
    os.utime(first, ns=(past - 10**9, past - 10**9))
    os.utime(second, ns=(past, past))
    assert isinstance(Tokenizer.from_pretrained(folders[0]).hf, SavedTokenizer)  # used again
    Tokenizer.from_pretrained(folders[2])
    kept = set(hf_cache.iterdir())
    assert len(kept) == 2 and first in kept and second not in kept
    assert isinstance(Tokenizer.from_pretrained(folders[0]).hf, SavedTokenizer)
    assert not isinstance(Tokenizer.from_pretrained(folders[1]).hf, SavedTokenizer)


def test_fim_ids(qwen: Tokenizer, starcoder: Tokenizer, mistral: Tokenizer) -> None:
    v = qwen.hf.get_vocab()
    ids = qwen.fim_ids("def add(a, b):\n    return ", "\n\nprint(add(1, 2))")
    assert ids[0] == v["<|fim_prefix|>"] and ids[-1] == v["<|fim_middle|>"]
    assert qwen.decode(ids, False) == ("<|fim_prefix|>def add(a, b):\n    return "
                                       "<|fim_suffix|>\n\nprint(add(1, 2))<|fim_middle|>")
    s = starcoder.fim_ids("x = ", "\n")
    assert starcoder.decode(s, False) == "<fim_prefix>x = <fim_suffix>\n<fim_middle>"
    assert mistral.fim_ids("a", "b") is None


@pytest.mark.smollm
def test_smollm_tokenizer(smollm_hf_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(smollm_hf_dir)
    assert tok.eos_token_ids == (2,) and tok.vocab_size == 49152
    assert tok.apply_chat_template(CHAT) == _hf_ids(tok, CHAT)
    assert tok.apply_chat_template(CHAT[1:]) == _hf_ids(tok, CHAT[1:])  # default system
    assert tok.fim_ids("a", "b") is None  # SmolLM2's GGUF vocab has no FIM tokens
    for answer in ("The capital of France is Paris.", "Paris 🙂\n\nIt's lovely!"):
        _check_next_turn(tok, answer, "And of Italy?", eos=True)
        _check_next_turn(tok, answer, "And of Italy?", eos=False)


def test_next_turn_follows_a_template_that_drops_past_thinking(hf_tokenizers) -> None:
    """A thinking model's template leaves the thinking of past answers out of the prompt:
    the next turn is the template's own rendering (not the exact ids, which hold the thinking),
    and its tokens up to the past answer are the previous prompt's (what the prefix cache
    reuses)."""
    from tests.model.test_thinking import QWEN3_LIKE

    tok = Tokenizer(hf_tokenizers["qwen"])
    tok.chat_template = QWEN3_LIKE
    history = [CHAT[1]]
    prompt = tok.apply_chat_template(history)
    answer = "<think>\nThe user wants a capital.\n</think>\n\nParis."
    history_ids = prompt + tok.encode(answer) + [tok.eos_token_ids[0]]
    history.append({"role": "assistant", "content": answer})
    new = [{"role": "user", "content": "Thanks"}]
    got = tok.next_turn_ids(history_ids, history, new)
    assert got == tok.apply_chat_template(history + new)
    assert "The user wants" not in tok.decode(got, False)
    assert got[: len(prompt)] == prompt
