"""Gemma 3 text against transformers (fp32, eager attention) on a tiny random model with the
family's options on: (1 + w) norms around attention and MLP, GeGLU, scaled embeddings, q/k
norms, query_pre_attn_scalar apart from head_dim, five local sliding-window layers (window
20, shorter than most prompts) and a global one, each kind with its rope base, linear rope
scaling on the global layers. Greedy tokens and log-probabilities equal, cold and
prefix-cached, eight requests mixed in chunked steps: through the torch path, the CPU kernels
(a Q8_0 GGUF on each kernel build) and the Triton kernels (interpreter); the model written as
a `gemma3` GGUF (llama.cpp's names, norms stored as 1 + w) loads and gives the same."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from localpaged import LLM, SamplingParams
from localpaged.model.config import ModelConfig
from localpaged.model.gemma3 import Gemma3Options
from tests.engine.test_exactness import hf_greedy as exactness_greedy
from tests.engine.test_exactness import prompts
from tests.model.tiny_gguf import gguf_writer, llama_cpp_name, write_tensors

MAX_NEW = 8
WINDOW = 20
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)

_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
          "pre_feedforward_layernorm": "ffn_norm",
          "post_feedforward_layernorm": "post_ffw_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def _save_tiny_gemma3(path: Path, transform=None, query_pre_attn_scalar: int = 24) -> Path:
    """6 layers, Gemma 3's pattern: five local, then a global one (llama.cpp fixes the pattern
    at 6 for a `gemma3` GGUF, so the same model serves the GGUF tests); `transform` maps each weight (numpy)
    before saving (the Q8_0 round trip). A GGUF cannot say query_pre_attn_scalar: llama.cpp
    takes head_dim (32 here), as the released models have it, so those tests use 32."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        sliding_window=WINDOW, query_pre_attn_scalar=query_pre_attn_scalar,
        rope_theta=100000.0, rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0}, initializer_range=0.1,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # they start at zero: make them matter
                p.uniform_(-0.5, 0.5)
            elif transform is not None:
                p.copy_(torch.from_numpy(transform(p.numpy())))
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


def hf_greedy(folder: Path, batch: list[list[int]], max_new: int = MAX_NEW
              ) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy tokens and their log-probabilities, eager attention, fp32 (its
    own cache keeps the sliding layers' window)."""
    return exactness_greedy(folder, batch, max_new, attn_implementation="eager")


@pytest.fixture(scope="module")
def reference(tiny_gemma3: Path) -> tuple[list, list, list]:
    batch = prompts(8)  # 1 to 70 tokens
    return batch, *hf_greedy(tiny_gemma3, batch)


def _check(outs: list, tokens: list, logprobs: list, tol: float = 2e-4) -> None:
    for out, toks, lps in zip(outs, tokens, logprobs, strict=True):
        assert out.outputs[0].token_ids == toks
        assert [lp.logprob for lp in out.outputs[0].logprobs] == pytest.approx(lps, abs=tol)


def write_gemma3_gguf(folder: Path, path: Path, qtype: str = "F32") -> Path:
    """The HF Gemma 3 in `folder` as llama.cpp's converter writes a `gemma3` GGUF: its tensor
    names, norm weights + 1, no lm_head (tied), 2-D tensors as `qtype`."""
    import gguf
    from safetensors.numpy import load_file

    w = gguf_writer(path, "gemma3", ModelConfig.from_pretrained(folder), pre=None)
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(2.0)
    w.add_sliding_window(WINDOW)
    tensors = {}
    for hf, value in load_file(folder / "model.safetensors").items():
        name = llama_cpp_name(hf, _NAMES, _TOP)
        if name.endswith("norm.weight"):
            value = value.astype(np.float32) + np.float32(1.0)  # llama.cpp's norm_shift
        tensors[name] = value
    write_tensors(w, tensors, qtype)
    return path


def test_config_reads_gemma3(tiny_gemma3: Path, tmp_path: Path) -> None:
    cfg = ModelConfig.from_pretrained(tiny_gemma3)
    opts = Gemma3Options.from_config(cfg)
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.qk_norm and cfg.tie_word_embeddings
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling == {"rope_type": "linear",
                                                                "factor": 2.0}
    assert opts.sliding == (True,) * 5 + (False,) and opts.sliding_window == WINDOW
    assert opts.local_rope_theta == 10000.0 and opts.query_pre_attn_scalar == 24
    # a transformers-4 config.json (the released models'): pattern 6, legacy rope keys
    legacy = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 8, "hidden_size": 8,
              "intermediate_size": 8, "num_hidden_layers": 12, "num_attention_heads": 2,
              "head_dim": 4, "sliding_window": 512, "rope_local_base_freq": 10000,
              "rope_theta": 1000000, "sliding_window_pattern": 6}
    old = ModelConfig.from_dict(legacy)
    assert old.rope_theta == 1e6 and old.tie_word_embeddings
    assert [i for i, s in enumerate(Gemma3Options.from_config(old).sliding) if not s] == [5, 11]
    gguf_cfg = ModelConfig.from_dict(
        __import__("localpaged.model.gguf_loader", fromlist=["open_gguf"]).open_gguf(
            write_gemma3_gguf(tiny_gemma3, tmp_path / "g.gguf")).hf_config())
    gopts = Gemma3Options.from_config(gguf_cfg)
    assert gopts.sliding == opts.sliding and gopts.sliding_window == WINDOW
    assert gopts.query_pre_attn_scalar == 32  # llama.cpp's: head_dim
    assert gguf_cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_engine_equals_transformers_cold_and_cached(tiny_gemma3: Path, reference: tuple) -> None:
    """Eight requests (1 to 70 tokens; window 20) in 32-token chunked steps, then again from the
    prefix cache: transformers' tokens and log-probabilities. Without the window the engine
    would not match: the window is exercised."""
    batch, tokens, logprobs = reference
    llm = LLM(str(tiny_gemma3), dtype="float32", kv_cache_dtype="float32", block_size=16, max_num_batched_tokens=32)
    assert llm.engine.model.cpu_decode is None
    for _ in range(2):
        _check(llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY), tokens, logprobs)
    assert llm.engine.stats().prefix_cache_hits > 0
    for layer in llm.engine.model.model.layers:
        layer.self_attn.window = None
    outs = llm.generate([{"prompt_token_ids": batch[-1]}], GREEDY)
    got = [lp.logprob for lp in outs[0].outputs[0].logprobs]
    assert max(abs(a - b) for a, b in zip(got, logprobs[-1])) > 1e-2


def test_a_gemma3_gguf_gives_transformers_tokens(tmp_path: Path) -> None:
    folder = _save_tiny_gemma3(tmp_path / "hf", query_pre_attn_scalar=32)
    batch = prompts(8)
    tokens, logprobs = hf_greedy(folder, batch)
    path = write_gemma3_gguf(folder, tmp_path / "gemma3.gguf")
    llm = LLM(str(path), dtype="float32", kv_cache_dtype="float32", block_size=16, max_num_batched_tokens=32)
    for _ in range(2):  # the second time from the prefix cache
        _check(llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY), tokens, logprobs)
    assert llm.engine.stats().prefix_cache_hits > 0


def _q8_round_trip(values: np.ndarray) -> np.ndarray:
    import gguf
    from gguf.quants import dequantize, quantize

    if values.ndim != 2:
        return values
    kind = gguf.GGMLQuantizationType.Q8_0
    return dequantize(quantize(values.astype(np.float32), kind), kind).reshape(values.shape)


@pytest.fixture(scope="module")
def q8_case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list, list, list]:
    """A Q8_0 `gemma3` GGUF, prompts, and transformers' greedy answers on its Q8_0 values."""
    folder = tmp_path_factory.mktemp("gemma3-q8")
    plain = _save_tiny_gemma3(folder / "plain", query_pre_attn_scalar=32)
    rounded = _save_tiny_gemma3(folder / "rounded", _q8_round_trip, 32)
    path = write_gemma3_gguf(plain, folder / "gemma3-q8.gguf", "Q8_0")
    batch = prompts(8)[3:]  # 16 to 70 tokens
    return path, batch, *hf_greedy(rounded, batch, 4)


def test_q8_0_gguf_on_each_cpu_kernel_build(q8_case: tuple, cpu_variant: str) -> None:
    """A Q8_0 `gemma3` GGUF computes its matrices on the CPU kernels (int8 blocks; the native
    decode layer refused) where the build takes int8 activations, else dequantized. Against
    transformers on the same Q8_0 values: equal tokens and log-probabilities when dequantized;
    with int8 activations (rounded per block) each first token transformers' best or within
    0.1 of it."""
    from localpaged.quant import cpu_w4
    from localpaged.quant.q8_linear import Q8Linear

    path, batch, ref_tokens, ref_logprobs = q8_case
    llm = LLM(str(path), dtype="float32", kv_cache_dtype="float32", block_size=16, max_num_batched_tokens=32)
    model = llm.engine.model
    int8 = cpu_w4.available() and cpu_w4.int8_activations()
    # the other builds take the file's values dequantized to float32
    assert any(isinstance(m, Q8Linear) for m in model.modules()) == int8
    assert model.cpu_decode is None and not llm.engine.optimizations["native_decode"]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
    if not int8:
        _check(outs, ref_tokens, ref_logprobs, tol=1e-4)
        return
    for out, toks, lps in zip(outs, ref_tokens, ref_logprobs, strict=True):
        got = out.outputs[0]
        assert got.token_ids[0] == toks[0] or abs(got.logprobs[0].logprob - lps[0]) < 0.1


def test_bf16_engine_stays_close_to_transformers(tiny_gemma3: Path, reference: tuple) -> None:
    """bf16 on the CPU (the C decode-attention kernel while a context fits its window, the
    masked torch path past it): each first token transformers' best or within 0.1."""
    batch, tokens, logprobs = reference
    llm = LLM(str(tiny_gemma3), dtype="bfloat16", block_size=16, max_num_batched_tokens=32)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)
    for out, toks, lps in zip(outs, tokens, logprobs, strict=True):
        got = out.outputs[0]
        assert got.token_ids[0] == toks[0] or abs(got.logprobs[0].logprob - lps[0]) < 0.1


def test_triton_kernels_equal_transformers(tiny_gemma3: Path, reference: tuple,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole engine on the Triton kernels (interpreter): windowed decode and prefill
    kernels, cold and from the prefix cache."""
    monkeypatch.setenv("LOCALPAGED_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    batch, tokens, logprobs = reference
    pick = [1, 5]  # 5 and 33 tokens
    llm = LLM(str(tiny_gemma3), dtype="float32", kv_cache_dtype="float32", block_size=16, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=1)
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": batch[i]} for i in pick], params)
        _check(outs, [tokens[i][:3] for i in pick], [logprobs[i][:3] for i in pick], tol=1e-3)
    assert llm.engine.stats().prefix_cache_hits > 0
