"""The whole engine through the Triton kernels (interpreter on the CPU): greedy tokens equal
to the torch path for a mixed batch with chunked prefill and prefix-cache hits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from localpaged import LLM, SamplingParams


def run(folder: Path, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=24, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    first = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    again = [o.outputs[0].token_ids for o in llm.generate(batch, params)]  # prefix hits
    assert again == first
    return first, llm.engine.stats().prefix_cache_hits


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3", "tiny_qwen3_moe"])
def test_engine_on_triton_kernels_matches_torch(fixture: str, request: pytest.FixtureRequest,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    folder = request.getfixturevalue(fixture)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (1, 17, 40)]
    monkeypatch.setenv("LOCALPAGED_KERNELS", "torch")
    ref, _ = run(folder, prompts)
    monkeypatch.setenv("LOCALPAGED_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got, hits = run(folder, prompts)
    assert hits > 0
    assert got == ref


def test_unsupported_head_dim_fails_at_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=36, intermediate_size=32,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1)).save_pretrained(tmp_path)
    monkeypatch.setenv("LOCALPAGED_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="head_dim 18"):
        LLM(str(tmp_path), dtype="float32")
