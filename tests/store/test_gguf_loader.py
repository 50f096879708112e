"""The GGUF reader: HF config and HF-named weights from GGUF files, against the weights that
went in (small files written like llama.cpp writes them) and against transformers on the real
SmolLM2-135M file. Damaged files give a ValueError naming the file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from ggufmaker import HEADS, KV_HEADS, TEMPLATE, tiny_hf_weights, write_tiny_gguf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localpaged.model.gguf_loader import GGUFFile, read_gguf, unpermute_rotary

# Largest error per weight, as a fraction of the largest |value| in its 32-value block.
TOLERANCE = {"F32": 0.0, "F16": 1e-3, "BF16": 8e-3, "Q8_0": 1 / 127, "Q4_0": 1 / 8, "Q4_1": 1 / 14}


@pytest.mark.parametrize("qtype", list(TOLERANCE))
def test_weights_round_trip_within_quantization_error(tmp_path, qtype):
    ref = tiny_hf_weights()
    _config, weights = read_gguf(write_tiny_gguf(tmp_path / f"t-{qtype}.gguf", qtype))
    got = dict(weights)
    assert set(got) == set(ref)
    for name, want in ref.items():
        have = got[name].numpy()
        assert got[name].dtype == torch.float32 and have.shape == want.shape, name
        if want.ndim == 1:
            np.testing.assert_array_equal(have, want)  # norms stay F32
            continue
        blocks = np.abs(want).reshape(want.shape[0], -1, 32).max(axis=-1, keepdims=True)
        err = np.abs(have - want).reshape(want.shape[0], -1, 32)
        assert (err <= TOLERANCE[qtype] * blocks + 1e-7).all(), (name, float(err.max()))


def test_config_from_metadata(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf", "Q8_0", tie=True)
    config, weights = read_gguf(path)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"], config["intermediate_size"], config["num_hidden_layers"]) == (
        64, HEADS, KV_HEADS, 16, 128, 1)
    assert config["rope_theta"] == 10000.0 and config["max_position_embeddings"] == 256
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 64
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert "lm_head.weight" not in dict(weights)
    gguf = GGUFFile(path)
    assert gguf.chat_template == TEMPLATE and gguf.quantization == "Q8_0"


def test_unpermute_inverts_llama_cpp_permutation():
    from ggufmaker import llama_cpp_permute

    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for heads in (1, 2, 8):
        np.testing.assert_array_equal(unpermute_rotary(llama_cpp_permute(w, heads), heads), w)


@pytest.mark.smollm
def test_real_smollm_matches_transformers(smollm_gguf, smollm_hf_dir):
    """Our weights equal the state dict transformers loads from the same GGUF
    (`smollm_hf_dir` is that model, saved by transformers)."""
    from safetensors.torch import load_file

    config, weights = read_gguf(smollm_gguf)
    ref = load_file(str(smollm_hf_dir / "model.safetensors"))
    seen = set()
    for name, tensor in weights:
        seen.add(name)
        assert tensor.shape == ref[name].shape, name
        assert float((tensor - ref[name].float()).abs().max()) <= 1e-6, name
    assert seen == set(ref) - {"lm_head.weight"}  # tied to the embedding
    import json

    hf = json.loads((smollm_hf_dir / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "tie_word_embeddings", "max_position_embeddings"):
        assert config[key] == hf[key], key
    assert config["rope_theta"] == 100000.0 and config["eos_token_id"] == 2


@pytest.mark.smollm
def test_real_smollm_tokenizer_template_and_cache(smollm_gguf, smollm_hf_dir, store_home):
    """The tokenizer from GGUF metadata encodes like the HF one and renders the chat template;
    the conversion is saved once and loaded from the cache after that."""
    from transformers import AutoTokenizer

    from localpaged.model.gguf_loader import (
        gguf_eos_token_ids,
        hf_tokenizer_from_gguf,
        tokenizer_cache_dir,
    )

    converted = hf_tokenizer_from_gguf(smollm_gguf)
    [entry] = tokenizer_cache_dir("gguf").iterdir()
    assert (entry / "tokenizer.json").is_file() and str(tokenizer_cache_dir("gguf")).startswith(str(store_home))
    cached = hf_tokenizer_from_gguf(smollm_gguf)
    ref = AutoTokenizer.from_pretrained(smollm_hf_dir)
    text = "What is the capital of France? Paris, naturally."
    assert converted(text)["input_ids"] == cached(text)["input_ids"] == ref(text)["input_ids"]
    # The cache is read through the class it names, not AutoTokenizer: the same tokenizer.
    assert type(cached) is type(converted) is type(AutoTokenizer.from_pretrained(entry))
    assert cached.all_special_ids == converted.all_special_ids and len(cached) == len(converted)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    for tok in (converted, cached):
        rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert rendered.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                                 "<|im_start|>assistant\n")
    assert gguf_eos_token_ids(smollm_gguf) == [2] and cached.convert_ids_to_tokens(2) == "<|im_end|>"

    pytest.importorskip("localpaged.model.tokenizer")
    from localpaged.model.gguf_loader import tokenizer_from_gguf

    wrapped = tokenizer_from_gguf(smollm_gguf)  # from the cache
    assert 2 in wrapped.eos_token_ids and wrapped.chat_template == converted.chat_template


@pytest.mark.smollm
def test_truncated_real_file_names_the_file(smollm_gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm_gguf, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(10_000_000))
    with pytest.raises(ValueError, match=r"cut\.gguf.*truncated"):
        read_gguf(cut)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 a zip, not a gguf")
    with pytest.raises(ValueError, match=r"model\.gguf: not a GGUF file"):
        read_gguf(bad)


_TINY: list[bytes] = []


def tiny_bytes() -> bytes:
    """A small Q4_0 GGUF file's bytes (written once per session)."""
    if not _TINY:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            _TINY.append(write_tiny_gguf(Path(d) / "t.gguf", "Q4_0").read_bytes())
    return _TINY[0]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_truncated_anywhere_gives_value_error_naming_file(tmp_path, data):
    end = data.draw(st.integers(0, len(tiny_bytes()) - 1))
    path = tmp_path / "broken.gguf"
    path.write_bytes(tiny_bytes()[:end])
    with pytest.raises(ValueError, match=r"broken\.gguf"):
        _config, weights = read_gguf(path)
        list(weights)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_corrupt_bytes_never_crash_outside_value_error(tmp_path, data):
    """Changing header bytes either still reads or fails with a ValueError naming the file."""
    buf = bytearray(tiny_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, 2000))  # header, metadata and tensor infos
        buf[i] = data.draw(st.integers(0, 255))
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(bytes(buf))
    try:
        _config, weights = read_gguf(path)
        for _name, _tensor in weights:
            pass
    except ValueError as exc:
        assert "corrupt.gguf" in str(exc)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_int4_weights_keep_q4_exact(tmp_path, qtype):
    """Q4_0/Q4_1 matrices map onto the quant room's Int4Weight with the very same values
    (q/k permutation undone on codes, scales and zeros alike)."""
    from localpaged.model.gguf_loader import open_gguf
    from localpaged.quant.layout import Int4Weight

    gguf = open_gguf(write_tiny_gguf(tmp_path / f"t-{qtype}.gguf", qtype))
    dense = dict(gguf.weights())
    packed = dict(gguf.int4_weights())
    assert set(packed) == set(dense)
    for name, value in packed.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, dense[name]), name  # norms: float as before
            continue
        assert isinstance(value, Int4Weight) and value.group_size == 32, name
        torch.testing.assert_close(value.dequantize(), dense[name], rtol=0, atol=1e-6)


@pytest.mark.smollm
def test_int4_weights_of_real_smollm_layer0(smollm_gguf):
    from localpaged.model.gguf_loader import open_gguf

    gguf = open_gguf(smollm_gguf)
    dense = {}
    for name, value in gguf.weights():
        if name.startswith("model.layers.0."):
            dense[name] = value
        elif dense:
            break
    for name, value in gguf.int4_weights():
        if name in dense and not isinstance(value, torch.Tensor):
            torch.testing.assert_close(value.dequantize(), dense[name], rtol=0, atol=1e-6)
            dense.pop(name)
        if name.startswith("model.layers.1."):
            break
    assert set(dense) == {"model.layers.0.input_layernorm.weight",
                          "model.layers.0.post_attention_layernorm.weight"}


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    """llama.cpp stores Llama 3.x rope scaling as a `rope_freqs` tensor; the config gets the
    parameters back, checked against transformers' own llama3 rope computation."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from localpaged.model.gguf_loader import llama3_rope_factors

    freqs = llama3_rope_factors(10000.0, 16, 8.0, 1.0, 4.0, 8192)
    assert freqs.min() == 1.0 and freqs.max() == 8.0 and ((freqs > 1) & (freqs < 8)).any()  # 3 regimes
    config, weights = read_gguf(write_tiny_gguf(tmp_path / "l3.gguf", "F32", rope_freqs=freqs))
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert "rope_freqs.weight" not in dict(weights)
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=10000.0,
                     max_position_embeddings=256, rope_scaling=config["rope_scaling"])
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    base = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)
    np.testing.assert_allclose(base / inv_freq.numpy(), freqs, rtol=1e-5)

    odd = write_tiny_gguf(tmp_path / "odd.gguf", "F32", rope_freqs=np.linspace(1, 3, 8))
    with pytest.raises(ValueError, match=r"odd\.gguf: rope_freqs.weight does not match"):
        read_gguf(odd)


@pytest.mark.smollm
def test_saved_tokenizer_answers_as_transformers(smollm_gguf, store_home):
    """A converted tokenizer, read back with the `tokenizers` backend alone (transformers
    imported beside it), encodes, decodes and names tokens exactly as the transformers one."""
    import random

    from localpaged.model.gguf_loader import hf_tokenizer_from_gguf, tokenizer_from_gguf
    from localpaged.model.saved_tokenizer import SavedTokenizer

    ref = hf_tokenizer_from_gguf(smollm_gguf)  # converts and saves
    tok = tokenizer_from_gguf(smollm_gguf)
    fast = tok.hf
    assert isinstance(fast, SavedTokenizer)
    assert not fast._started  # transformers' tokenizer: built only when asked for
    assert (len(fast), fast.eos_token_id, fast.bos_token_id, fast.chat_template) == (
        len(ref), ref.eos_token_id, ref.bos_token_id, ref.chat_template)
    assert fast.get_vocab() == ref.get_vocab()
    texts = ["What is the capital of France?", "  two  spaces\tand\ttabs\n\nnewlines ",
             "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "Café 中文 🙂 naïve",
             "def f(x):\n    return x ** 2  # code", "", " ", "<fim_prefix>a<fim_suffix>b"]
    for text in texts:
        for special in (True, False):
            assert fast.encode(text, add_special_tokens=special) == ref.encode(
                text, add_special_tokens=special), (text, special)
    rng = random.Random(0)
    specials = sorted(ref.all_special_ids)
    for _ in range(50):
        ids = [rng.randrange(len(ref)) for _ in range(rng.randrange(1, 30))]
        ids[rng.randrange(len(ids))] = rng.choice(specials)
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        assert [fast.convert_ids_to_tokens(i) for i in ids] == ref.convert_ids_to_tokens(ids)
    assert {i for i, t in fast.added_tokens_decoder.items() if t.special} == {
        i for i, t in ref.added_tokens_decoder.items() if t.special}
    assert not fast._started  # encode, decode and token names need only the backend
    fast.wait_ready()  # nothing started: returns at once
    chat = [{"role": "user", "content": "Hello?"}]
    assert tok.render_chat(chat) == ref.apply_chat_template(chat, tokenize=False,
                                                            add_generation_prompt=True)
    assert not fast._started  # the template renders without transformers
    assert type(tok.hf_full) is type(ref)
