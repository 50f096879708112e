"""Qwen3 dense: its config read as such, and a tiny random Qwen3 written as a GGUF of the
`qwen3` architecture (llama.cpp's tensor names, q/k norms included, rows not permuted) gives
transformers' greedy tokens and log-probabilities through the engine, as the HF folder does
(tests/model/test_llama.py and tests/engine/test_exactness.py run that folder)."""

from __future__ import annotations

from pathlib import Path

import pytest

from localpaged import LLM, SamplingParams
from localpaged.model.config import ModelConfig
from tests.engine.test_exactness import MAX_NEW, hf_greedy, prompts
from tests.model.tiny_gguf import gguf_writer, llama_cpp_name, write_tensors

_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def write_qwen3_gguf(folder: Path, path: Path, qtype: str = "F32") -> Path:
    """The HF Qwen3 in `folder` as a GGUF of the `qwen3` architecture, as llama.cpp's
    converter names and lays out its tensors (2-D ones as `qtype`, norms F32)."""
    from safetensors.numpy import load_file

    w = gguf_writer(path, "qwen3", ModelConfig.from_pretrained(folder))
    tensors = {llama_cpp_name(hf, _NAMES, _TOP): v
               for hf, v in load_file(folder / "model.safetensors").items()}
    write_tensors(w, tensors, qtype)
    return path


def _first_logprobs(folder: Path, batch: list[list[int]]) -> list:
    """transformers' float32 log-probabilities of each prompt's next token."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0, -1], -1) for p in batch]


def test_config_reads_qwen3(tiny_qwen3: Path) -> None:
    cfg = ModelConfig.from_pretrained(tiny_qwen3)
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm
    assert cfg.head_dim == 32 and cfg.hidden_size // cfg.num_heads == 16
    assert not cfg.qkv_bias and not cfg.o_bias and cfg.sliding_window is None
    assert not ModelConfig.from_dict({**cfg.raw, "architectures": ["Qwen2ForCausalLM"]}).qk_norm


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_a_qwen3_gguf_gives_transformers_tokens(tiny_qwen3: Path, tmp_path: Path,
                                                dtype: str) -> None:
    """The F32 GGUF in float32 (and with the defaults: bf16 or float32 by the CPU) gives the
    HF model's greedy tokens; float32 its log-probabilities too, cold and prefix-cached."""
    path = write_qwen3_gguf(tiny_qwen3, tmp_path / "qwen3.gguf")
    batch = prompts(6)
    ref_tokens, ref_logprobs = hf_greedy(tiny_qwen3, batch)
    llm = LLM(str(path), dtype=dtype, block_size=16, max_num_batched_tokens=32)
    assert llm.engine.model_config.qk_norm
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
    for _ in range(2):  # the second time from the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
        if dtype == "float32":
            for out, toks, lps in zip(outs, ref_tokens, ref_logprobs, strict=True):
                assert out.outputs[0].token_ids == toks
                got = [lp.logprob for lp in out.outputs[0].logprobs]
                assert got == pytest.approx(lps, abs=2e-4)
        else:  # bf16 rounding may break a near tie (random tiny weights have many): each
            # first token is transformers' best or within 0.1 of it in log-probability
            for out, first in zip(outs, _first_logprobs(tiny_qwen3, batch), strict=True):
                assert first.max() - first[out.outputs[0].token_ids[0]] < 0.1
    assert llm.engine.stats().prefix_cache_hits > 0


def test_a_q8_0_qwen3_gguf_decodes_natively(tiny_qwen3: Path, tmp_path: Path) -> None:
    """A Q8_0 qwen3 GGUF on the CPU kernels: the native decode layer (which applies the q/k
    norms) is taken, and gives the torch layers' greedy tokens."""
    path = write_qwen3_gguf(tiny_qwen3, tmp_path / "qwen3-q8.gguf", "Q8_0")
    batch = [{"prompt_token_ids": p} for p in prompts(4)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(path), dtype="float32")
    if not llm.engine.optimizations["native_decode"]:
        pytest.skip("the native decode layer does not serve this model here (no C kernels)")
    native = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    llm.engine.model.cpu_decode = None  # the torch layers alone
    plain = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    assert native == plain
