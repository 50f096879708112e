"""Phi-3 / Phi-4-mini (`Phi3ForCausalLM`, GGUF `phi3`) against transformers fp32 on tiny random
models with the family's options on: q/k/v and gate/up fused in the checkpoint, LongRoPE
(original length 32 of 128: prompts on both sides of it), and Phi-4-mini's partial rotary and
tied embeddings ("phi4") or Phi-3.5-mini's full rotary and separate output layer ("phi3").

Checked: the rotary tables, prefill/decode logits over paged blocks, the engine's greedy tokens
and log-probabilities (one batch of short and long prompts, cold and prefix-cached, the long
factors' blocks kept apart from the short ones'), the same models as GGUF files (F32: the same
numbers; Q4_0: the CPU kernels, against transformers on the dequantized weights) and the engine
on the Triton kernels (interpreter)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from localpaged import LLM, SamplingParams
from localpaged.model.config import ModelConfig
from localpaged.model.loader import load_model
from localpaged.model.rope import build_cos_sin
from tests.engine.test_exactness import MAX_NEW, hf_greedy
from tests.model.tiny_gguf import (
    byte_level_bpe,
    gguf_writer,
    llama_cpp_name,
    rounded_copy,
    write_tensors,
)

ORIGINAL = 32  # original_max_position_embeddings: longer prompts take the long factors
MAX_POS = 128
# Prompts short enough that transformers keeps the short factors through MAX_NEW tokens
# (its last forward sees position len + MAX_NEW - 2 < ORIGINAL), and long ones.
SHORT, LONG = (1, 5, 15, 17, 23), (33, 48, 70)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)

_GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
               "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def _save_tiny_phi3(path: Path, partial: bool) -> Path:
    """A random 2-layer Phi3ForCausalLM (GQA 4:2, head dim 16) with LongRoPE, saved by
    transformers; `partial`: Phi-4-mini's rotary over 3/4 of each head and tied embeddings."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    rot = 12 if partial else 16
    config = Phi3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POS,
        original_max_position_embeddings=ORIGINAL, rms_norm_eps=1e-5,
        tie_word_embeddings=partial, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        sliding_window=None, partial_rotary_factor=0.75 if partial else 1.0,
        rope_scaling={"type": "longrope",
                      "short_factor": (1 + torch.rand(rot // 2, generator=g)).tolist(),
                      "long_factor": (2 + 6 * torch.rand(rot // 2, generator=g)).tolist()})
    model = Phi3ForCausalLM(config)
    with torch.no_grad():  # sharper attention: positions (and so the factors) matter more
        for layer in model.model.layers:
            layer.self_attn.qkv_proj.weight.mul_(6)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def tiny_phi4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny_phi3(tmp_path_factory.mktemp("tiny-phi4"), partial=True)


@pytest.fixture(scope="module")
def tiny_phi3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny_phi3(tmp_path_factory.mktemp("tiny-phi3"), partial=False)


@pytest.fixture(scope="module", params=["tiny_phi4", "tiny_phi3"])
def tiny(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def reference(tiny: Path) -> tuple[list[list[int]], list, list]:
    """Short and long prompts and transformers' greedy tokens and log-probabilities."""
    batch = [_ids(n, n) for n in SHORT + LONG]
    return (batch, *hf_greedy(tiny, batch))


def write_phi3_gguf(folder: Path, path: Path, qtype: str = "F32") -> Path:
    """The HF Phi-3 in `folder` as a `phi3` GGUF, named and laid out as llama.cpp's converter
    does (fused attn_qkv and ffn_up, rope.dimension_count the rotary width, LongRoPE as the
    rope_factors_long/short tensors beside the original context length and attention
    factor); 2-D tensors as `qtype`."""
    from safetensors.numpy import load_file

    cfg = ModelConfig.from_pretrained(folder)
    scaling = cfg.rope_scaling or {}
    tokens, merges = byte_level_bpe(cfg.vocab_size)
    tokens[-1] = "<|end|>"  # Phi's end of turn (the file's eos is another token)
    w = gguf_writer(path, "phi3", cfg, head_dim_keys=False, vocabulary=(tokens, merges))
    w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    w.add_rope_dimension_count(cfg.rotary_dim)
    w.add_sliding_window(0)
    scale = cfg.max_position_embeddings / scaling["original_max_position_embeddings"]
    w.add_rope_scaling_attn_factors(
        float(np.sqrt(1 + np.log(scale) / np.log(scaling["original_max_position_embeddings"]))))
    tensors = {"rope_factors_long.weight": np.array(scaling["long_factor"], np.float32),
               "rope_factors_short.weight": np.array(scaling["short_factor"], np.float32)}
    tensors |= {llama_cpp_name(hf, _GGUF_LAYER, _GGUF_TOP): v
                for hf, v in load_file(folder / "model.safetensors").items()}
    write_tensors(w, tensors, qtype)
    return path


def _dequantized_copy(folder: Path, target: Path, qtype: str) -> Path:
    """The HF folder with each 2-D weight rounded through `qtype` and back: transformers'
    model of what a `qtype` GGUF of it holds."""
    return rounded_copy(folder, target, qtype)


def _check(outs: list, ref_tokens: list, ref_logprobs: list, atol: float = 2e-4) -> None:
    for out, toks, lps in zip(outs, ref_tokens, ref_logprobs, strict=True):
        assert out.outputs[0].token_ids == toks
        assert [lp.logprob for lp in out.outputs[0].logprobs] == pytest.approx(lps, abs=atol)


# -- config and rotary tables ---------------------------------------------------------------

def test_config_reads_phi4_mini_and_saved_phi3(tiny_phi4: Path) -> None:
    """Phi-4-mini's own config.json shape (transformers 4: top-level partial_rotary_factor and
    original length, rope_scaling "type") and a transformers 5 save read the same."""
    saved = ModelConfig.from_pretrained(tiny_phi4)
    assert saved.architecture == "Phi3ForCausalLM" and saved.tie_word_embeddings
    assert (saved.head_dim, saved.rotary_dim, saved.partial_rotary_factor) == (16, 12, 0.75)
    assert saved.rope_type == "longrope" and not (saved.qkv_bias or saved.mlp_bias)
    assert saved.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    scaling = saved.rope_scaling
    v4 = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 512,
          "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": MAX_POS,
          "original_max_position_embeddings": ORIGINAL, "partial_rotary_factor": 0.75,
          "rope_theta": 10000.0, "tie_word_embeddings": True, "mlp_bias": False,
          "rope_scaling": {"type": "su", "short_factor": scaling["short_factor"],
                           "long_factor": scaling["long_factor"]}}
    old = ModelConfig.from_dict(v4)
    assert old.rotary_dim == 12 and old.rope_scaling == scaling
    assert torch.equal(build_cos_sin(old), build_cos_sin(saved))


def test_rotary_tables_equal_transformers(tiny: Path) -> None:
    """Our table's short rows are transformers' cos/sin for a sequence of the original length,
    its long rows (past max_position_embeddings) those for a longer one; the attention factor
    scales both."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = ModelConfig.from_pretrained(tiny)
    table = build_cos_sin(config)
    assert table.shape == (2 * MAX_POS, config.rotary_dim)
    rope = Phi3RotaryEmbedding(AutoConfig.from_pretrained(tiny))
    x = torch.zeros(1, dtype=torch.float32)
    for length, offset in ((ORIGINAL, 0), (MAX_POS, MAX_POS)):
        cos, sin = rope(x, torch.arange(length)[None])
        half = config.rotary_dim // 2
        assert torch.equal(table[offset:offset + length, :half], cos[0, :, :half])
        assert torch.equal(table[offset:offset + length, half:], sin[0, :, :half])
    model, _ = load_model(tiny, dtype="float32")
    assert [model.rope_offset(n) for n in (1, ORIGINAL, ORIGINAL + 1)] == [0, 0, MAX_POS]


# -- the model over paged blocks ----------------------------------------------------------

@pytest.mark.parametrize("n", [20, 70])
def test_chunked_prefill_and_decode_equal_transformers(tiny: Path, n: int, step_builder,
                                                       hf_logits) -> None:
    """Two prefill chunks and single-token decodes over scattered blocks, a short and a long
    prompt: every position's logits equal transformers' full-sequence ones (which take the
    long factors for the whole sequence when it is longer than the original length)."""
    model, _ = load_model(tiny, dtype="float32")
    ids = _ids(n, 7)
    off = model.rope_offset(n - 4)  # the prompt: all but the 4 decoded tokens
    table = [9, 2, 7, 0, 4][: -(-n // 16)]
    caches = model.allocate_kv_caches(num_blocks=10, block_size=16, dtype=model.dtype)
    got = []
    for start, end in ((0, 13), (13, n - 4), *((p, p + 1) for p in range(n - 4, n))):
        positions, meta = step_builder([(table, start, end - start)], 16)
        hidden = model(torch.tensor(ids[start:end]), positions + off, caches, meta)
        got.append(model.compute_logits(hidden))
    torch.testing.assert_close(torch.cat(got), hf_logits(tiny, ids), atol=1e-5, rtol=0)
    assert off == (MAX_POS if n > ORIGINAL else 0)


# -- the engine -----------------------------------------------------------------------------

def test_engine_equals_transformers_short_and_long_cold_and_cached(tiny: Path,
                                                                   reference: tuple) -> None:
    """Short and long prompts in one batch (chunked prefill, decodes beside prompt chunks):
    transformers' tokens and log-probabilities, then again from the prefix cache."""
    batch, ref_tokens, ref_logprobs = reference
    llm = LLM(str(tiny), dtype="float32", kv_cache_dtype="float32", max_num_batched_tokens=32, block_size=16)
    for _ in range(2):
        _check(llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY), ref_tokens,
               ref_logprobs)
    assert llm.engine.stats().prefix_cache_hits > 0


def test_long_prompts_never_reuse_blocks_computed_with_short_factors(tiny_phi4: Path) -> None:
    """A 23-token prompt (short factors) and its answer leave two full blocks in the prefix
    cache; a 40-token prompt starting with it (long factors) computes them again, and a
    second long one takes the first long one's block. Every answer equals transformers'."""
    short = _ids(23, 3)
    long1, long2 = short + _ids(17, 4), short + _ids(18, 5)
    ref_tokens, ref_logprobs = hf_greedy(tiny_phi4, [short, long1, long2])
    llm = LLM(str(tiny_phi4), dtype="float32", kv_cache_dtype="float32", block_size=16)
    outs = [llm.generate({"prompt_token_ids": p}, GREEDY)[0] for p in (short, long1, long2)]
    _check(outs, ref_tokens, ref_logprobs)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 16]
    assert llm.generate({"prompt_token_ids": [*short, 5]}, GREEDY)[0].num_cached_tokens == 16
    # a chat whose next turn crosses the original length: of its history's two full blocks
    # (short factors) it takes none, only the long prompts' first block
    turn2 = short + outs[0].outputs[0].token_ids + _ids(5, 6)
    again = llm.generate({"prompt_token_ids": turn2}, GREEDY)[0]
    assert again.num_cached_tokens == 16
    assert again.outputs[0].token_ids == hf_greedy(tiny_phi4, [turn2])[0][0]


@pytest.mark.usefixtures("exact_float32")
@pytest.mark.parametrize("fixture", ["tiny_phi4", "tiny_phi3"])
def test_q4_gguf_on_the_cpu_kernels_equals_transformers(fixture: str, tmp_path: Path,
                                                        request: pytest.FixtureRequest) -> None:
    """A Q4_0 `phi3` GGUF on the CPU kernels (4-bit matmuls on the fused layers; float32 on the
    plain build: the file's numbers) gives transformers' tokens on the dequantized weights.
    Full rotary takes the native decode layer (its rows read at the long factors' offset),
    partial rotary the torch layers."""
    from localpaged.quant.linear import QuantLinear

    folder = request.getfixturevalue(fixture)
    path = write_phi3_gguf(folder, tmp_path / "phi3-q4.gguf", "Q4_0")
    batch = [_ids(n, n) for n in (5, 23, 40)]
    ref_tokens, ref_logprobs = hf_greedy(_dequantized_copy(folder, tmp_path / "hf", "Q4_0"),
                                         batch)
    llm = LLM(str(path), dtype="float32", kv_cache_dtype="float32", max_num_batched_tokens=32, block_size=16)
    model = llm.engine.model
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, QuantLinear)
    assert model.model.layers[0].self_attn.qkv_proj.w4_packed is not None
    assert llm.engine.optimizations["native_decode"] == (fixture == "tiny_phi3")
    for _ in range(2):
        _check(llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY), ref_tokens,
               ref_logprobs, atol=1e-3)


def test_q4_gguf_in_the_cpus_dtype_stays_close_to_transformers(tiny_phi4: Path,
                                                              tmp_path: Path) -> None:
    """The same Q4_0 GGUF with the defaults (bf16 where the CPU has it, int8 activations where
    its kernels take them): each answer's first token, short and long prompts, is
    transformers' best on the dequantized weights or within 0.1 of it in log-probability
    (rounding may break the near ties of random tiny weights)."""
    from transformers import AutoModelForCausalLM

    path = write_phi3_gguf(tiny_phi4, tmp_path / "phi4-q4.gguf", "Q4_0")
    hf = AutoModelForCausalLM.from_pretrained(_dequantized_copy(tiny_phi4, tmp_path / "hf", "Q4_0"),
                                              dtype=torch.float32).eval()
    batch = [_ids(n, n) for n in (5, 23, 40, 70)]
    llm = LLM(str(path), max_num_batched_tokens=32, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for _ in range(2):  # the second time from the prefix cache
        for prompt, out in zip(batch, llm.generate([{"prompt_token_ids": p} for p in batch],
                                                   params), strict=True):
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1], -1)
            assert ref.max() - ref[out.outputs[0].token_ids[0]] < 0.1


@pytest.mark.usefixtures("exact_float32")
@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_awq_and_gptq_checkpoints_load_into_the_fused_layers(tiny_phi4: Path, method: str,
                                                             tmp_path: Path, step_builder) -> None:
    """AWQ / GPTQ files of Phi-3 (qkv_proj.qweight ...) load by name into the fused layers:
    a long prompt's logits equal transformers' on the checkpoint's dequantized weights."""
    from transformers import AutoModelForCausalLM

    from localpaged.quant.awq import awq_quantize
    from localpaged.quant.linear import QuantLinear
    from localpaged.quant.writer import save_quantized
    from tests.quant.test_quantize_tiny import hf_reference_logits

    hf = AutoModelForCausalLM.from_pretrained(tiny_phi4, dtype=torch.float32)
    layers = {f"model.layers.{n}": awq_quantize(m.weight.data, 32)
              for n, m in hf.model.layers.named_modules() if isinstance(m, torch.nn.Linear)}
    folder = save_quantized(hf, layers, tmp_path / method, method, 32, sym=False)
    model, _ = load_model(folder, dtype="float32")
    assert isinstance(model.model.layers[1].mlp.gate_up_proj, QuantLinear)
    ids = _ids(40, 9)
    caches = model.allocate_kv_caches(num_blocks=3, block_size=16, dtype=model.dtype)
    positions, meta = step_builder([([2, 0, 1], 0, len(ids))], 16)
    hidden = model(torch.tensor(ids), positions + model.rope_offset(len(ids)), caches, meta)
    torch.testing.assert_close(model.compute_logits(hidden),
                               hf_reference_logits(tiny_phi4, folder, ids), atol=2e-4, rtol=1e-4)


def test_f32_gguf_equals_transformers(tiny: Path, tmp_path: Path, reference: tuple) -> None:
    """The F32 `phi3` GGUF reads as the HF folder (config, rope factors) and gives
    transformers' tokens and log-probabilities, cold and prefix-cached."""
    path = write_phi3_gguf(tiny, tmp_path / "phi3.gguf")
    batch, ref_tokens, ref_logprobs = reference
    llm = LLM(str(path), dtype="float32", kv_cache_dtype="float32", max_num_batched_tokens=32, block_size=16)
    ours, theirs = llm.engine.model_config, ModelConfig.from_pretrained(tiny)
    assert (ours.head_dim, ours.rotary_dim, ours.tie_word_embeddings) == (
        theirs.head_dim, theirs.rotary_dim, theirs.tie_word_embeddings)
    assert torch.allclose(build_cos_sin(ours), build_cos_sin(theirs), atol=1e-6)
    assert set(llm.engine.tokenizer.eos_token_ids) == {2, 511}  # eos and <|end|>
    for _ in range(2):
        _check(llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY), ref_tokens,
               ref_logprobs)
    assert llm.engine.stats().prefix_cache_hits > 0


def test_engine_on_triton_kernels_equals_transformers(tiny_phi4: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine through the Triton kernels (interpreter here; partial rotary in the rotary
    kernel): transformers' tokens for a short and a long prompt, cold and prefix-cached."""
    from tests.kernels.test_engine_triton import run

    batch = [_ids(n, n) for n in (17, 40)]
    ref_tokens, _ = hf_greedy(tiny_phi4, batch)
    monkeypatch.setenv("LOCALPAGED_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got, hits = run(tiny_phi4, batch)  # runs twice: the second from the prefix cache
    assert hits > 0
    assert got == [t[:6] for t in ref_tokens]


def test_catalog_names_phi4_mini(tmp_path: Path) -> None:
    from localpaged.store.catalog import load_catalog

    entry = load_catalog(tmp_path / "no-user-catalog.toml")["phi4-mini"]
    assert entry.repo == "bartowski/microsoft_Phi-4-mini-instruct-GGUF"
    assert entry.weight_format == "gguf" and entry.file == "microsoft_Phi-4-mini-instruct-Q4_K_M.gguf"
