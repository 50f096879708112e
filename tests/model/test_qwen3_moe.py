"""Qwen3-MoE: its config read as such, the expert block equal to transformers', and a tiny
random Qwen3-MoE (8 experts, top 2, renormalized; one dense layer) written as a GGUF of the
`qwen3moe` architecture (llama.cpp's names: the router `ffn_gate_inp`, the experts as 3-D
`ffn_*_exps` tensors) giving transformers' greedy tokens and log-probabilities, its experts in
float32, Q8_0 and Q4_0 (the CPU kernels). tests/engine/test_exactness.py and
tests/kernels/test_engine_triton.py run the HF folder through the engine's other paths."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from localpaged import LLM, SamplingParams
from localpaged.model.config import ModelConfig
from tests.engine.test_exactness import MAX_NEW, hf_greedy, prompts
from tests.model.tiny_gguf import gguf_writer, rounded_copy, write_tensors

_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}
_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def gguf_tensors(folder: Path) -> dict[str, np.ndarray]:
    """The HF folder's tensors under llama.cpp's qwen3moe names, the experts stacked."""
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for hf, value in load_file(folder / "model.safetensors").items():
        value = value.astype(np.float32)
        if hf in _TOP:
            out[_TOP[hf]] = value
            continue
        _, _, layer, *rest = hf.split(".")
        if rest[:2] == ["mlp", "experts"]:
            experts.setdefault(f"blk.{layer}.{_EXPERTS[rest[3]]}.weight", {})[int(rest[2])] = value
        else:
            out[f"blk.{layer}.{_NAMES['.'.join(rest[:-1])]}.{rest[-1]}"] = value
    for name, parts in experts.items():
        out[name] = np.stack([parts[e] for e in sorted(parts)])
    return out


def write_qwen3moe_gguf(folder: Path, path: Path, qtype: str = "F32") -> Path:
    """The HF Qwen3-MoE in `folder` as a `qwen3moe` GGUF, matrices (2-D and the 3-D experts)
    as `qtype`, norms and the routers F32 (llama.cpp never quantizes a router)."""
    cfg = ModelConfig.from_pretrained(folder)
    w = gguf_writer(path, "qwen3moe", cfg)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    write_tensors(w, gguf_tensors(folder), qtype, keep_f32=lambda name: "ffn_gate_inp" in name)
    return path


def dequantized_folder(folder: Path, out: Path, qtype: str) -> Path:
    """The float32 reference for a `qtype` GGUF of `folder`: every matrix rounded through the
    type, the routers as they are."""
    return rounded_copy(folder, out, qtype, keep=lambda name: name.endswith("mlp.gate.weight"))


def test_config_reads_qwen3_moe(tiny_qwen3_moe: Path) -> None:
    cfg = ModelConfig.from_pretrained(tiny_qwen3_moe)
    assert cfg.architecture == "Qwen3MoeForCausalLM" and cfg.qk_norm
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 64)
    assert cfg.num_layers == 3 and cfg.norm_topk_prob
    assert [cfg.is_moe_layer(i) for i in range(3)] == [True, False, True]


def test_expert_block_equals_transformers(tiny_qwen3_moe: Path) -> None:
    """The engine's expert block (tokens sorted by expert) on transformers' weights gives its
    output, with and without renormalized top-k weights."""
    from transformers import AutoModelForCausalLM

    from localpaged.model.moe import SparseMoE

    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe, dtype=torch.float32).eval()
    block = hf.model.layers[0].mlp
    cfg = ModelConfig.from_pretrained(tiny_qwen3_moe)
    ours = SparseMoE(cfg, torch.float32, "cpu")
    with torch.no_grad():
        ours.gate.weight.copy_(block.gate.weight)
        for e, expert in enumerate(ours.experts):
            gate, up = block.experts.gate_up_proj[e].chunk(2, dim=0)
            expert.gate_proj.weight.copy_(gate)
            expert.up_proj.weight.copy_(up)
            expert.down_proj.weight.copy_(block.experts.down_proj[e])
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for norm in (True, False):
        block.gate.norm_topk_prob = ours.norm_topk_prob = norm
        with torch.no_grad():
            assert torch.allclose(ours(x), block(x[None])[0], atol=1e-6)
    ours.fuse_projections()
    with torch.no_grad():
        assert torch.allclose(ours(x), block(x[None])[0], atol=1e-6)


def test_a_qwen3moe_gguf_gives_transformers_tokens(tiny_qwen3_moe: Path, tmp_path: Path) -> None:
    """F32 GGUF, float32: transformers' greedy tokens and log-probabilities, cold and from the
    prefix cache, prompts of several lengths read in shared chunked steps."""
    path = write_qwen3moe_gguf(tiny_qwen3_moe, tmp_path / "moe.gguf")
    batch = prompts(6)
    ref_tokens, ref_logprobs = hf_greedy(tiny_qwen3_moe, batch)
    llm = LLM(str(path), dtype="float32", block_size=16, max_num_batched_tokens=32)
    cfg = llm.engine.model_config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.mlp_only_layers) == (8, 2, (1,))
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
    for _ in range(2):  # the second time from the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
        for out, toks, lps in zip(outs, ref_tokens, ref_logprobs, strict=True):
            assert out.outputs[0].token_ids == toks
            assert [lp.logprob for lp in out.outputs[0].logprobs] == pytest.approx(lps, abs=2e-4)
    assert llm.engine.stats().prefix_cache_hits > 0


def _run(path: Path, batch: list[list[int]]) -> tuple[LLM, list]:
    llm = LLM(str(path), dtype="float32", block_size=16, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
    return llm, llm.generate([{"prompt_token_ids": p} for p in batch], params)


def test_4bit_experts_on_the_cpu_kernel(tiny_qwen3_moe: Path, tmp_path: Path,
                                        exact_float32: None) -> None:
    """Q4_0 experts kept 4-bit on the CPU kernel (the plain build multiplies float32
    exactly): transformers' tokens and log-probabilities on the dequantized weights."""
    path = write_qwen3moe_gguf(tiny_qwen3_moe, tmp_path / "moe-q4.gguf", "Q4_0")
    reference = dequantized_folder(tiny_qwen3_moe, tmp_path / "reference", "Q4_0")
    batch = prompts(4)
    ref_tokens, ref_logprobs = hf_greedy(reference, batch)
    llm, outs = _run(path, batch)
    expert = llm.engine.model.model.layers[0].mlp.experts[3].down_proj
    assert type(expert).__name__ == "QuantLinear" and expert.w4_packed is not None
    for out, toks, lps in zip(outs, ref_tokens, ref_logprobs, strict=True):
        assert out.outputs[0].token_ids == toks
        assert [lp.logprob for lp in out.outputs[0].logprobs] == pytest.approx(lps, abs=2e-4)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_experts_on_each_kernel_variant(tiny_qwen3_moe: Path, tmp_path: Path, qtype: str,
                                        cpu_variant: str) -> None:
    """Q8_0 and Q4_0 experts on every kernel build this CPU runs (activations rounded to int8
    from avx2 on): each prompt's first token is transformers' best on the dequantized
    weights, or within rounding (0.1 in log-probability) of it."""
    path = write_qwen3moe_gguf(tiny_qwen3_moe, tmp_path / f"moe-{qtype}.gguf", qtype)
    reference = dequantized_folder(tiny_qwen3_moe, tmp_path / "reference", qtype)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    batch = prompts(4)
    llm, outs = _run(path, batch)
    kept = type(llm.engine.model.model.layers[2].mlp.experts[0].gate_up_proj) is not torch.nn.Linear
    assert kept or (qtype == "Q8_0" and cpu_variant == "generic")  # no int8 path in plain C
    for p, out in zip(batch, outs, strict=True):
        with torch.no_grad():
            first = torch.log_softmax(hf(torch.tensor([p])).logits[0, -1], -1)
        assert first.max() - first[out.outputs[0].token_ids[0]] < 0.1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_native_decode_layer_runs_the_attention_around_the_experts(
        tiny_qwen3_moe: Path, tmp_path: Path, qtype: str, dtype: str) -> None:
    """The native decode layer serves a MoE model too (attention and norms in C, the router
    in torch, every chosen expert's MLP in one C call), with the torch layers' greedy
    tokens."""
    path = write_qwen3moe_gguf(tiny_qwen3_moe, tmp_path / f"moe-{qtype}.gguf", qtype)
    batch = [{"prompt_token_ids": p} for p in prompts(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(path), dtype=dtype)
    if not llm.engine.optimizations["native_decode"]:
        pytest.skip("the native decode layer does not serve this model here (no C kernels)")
    plan = llm.engine.model.cpu_decode
    assert [m is not None for m in plan.experts] == [True, False, True]
    assert plan.experts[0].gate_up is not None  # the experts' C call, not the torch module
    native = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    llm.engine.model.cpu_decode = None  # the torch layers alone
    plain = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    assert native == plain
