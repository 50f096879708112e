"""The real SmolLM2-135M-Instruct (converted from its GGUF to an fp32 HF folder): our logits
against transformers' on a chat prompt, prefilled in two chunks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from localpaged.model.loader import cpu_compute_dtype, load_model
from localpaged.model.tokenizer import Tokenizer

pytestmark = pytest.mark.smollm


def test_smollm_logits_match_hf(smollm_hf_dir: Path, step_builder, hf_logits) -> None:
    tok = Tokenizer.from_pretrained(smollm_hf_dir)
    ids = tok.apply_chat_template([
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France? Answer in one word."},
    ])
    model, config = load_model(smollm_hf_dir)
    assert config.tie_word_embeddings and config.num_layers == 30
    block = 16
    table = list(range(-(-len(ids) // block) + 2, 0, -1))
    caches = model.allocate_kv_caches(len(table) + 1, block, dtype=model.dtype)
    cut = 21
    got = []
    for start, end in ((0, cut), (cut, len(ids))):
        positions, meta = step_builder([(table, start, end - start)], block)
        hidden = model(torch.tensor(ids[start:end]), positions, caches, meta)
        got.append(model.compute_logits(hidden))
    ref = hf_logits(smollm_hf_dir, ids)
    torch.testing.assert_close(torch.cat(got), ref, atol=2e-4, rtol=1e-4)
    assert got[-1][-1].argmax() == ref[-1].argmax()


@pytest.mark.usefixtures("exact_float32")
def test_smollm_gguf_loads_like_hf(smollm_gguf: Path, smollm_hf_dir: Path, step_builder,
                                   hf_logits) -> None:
    """load_model on the .gguf itself (dequantized by our GGUF reader) gives the logits of
    transformers' own GGUF conversion (float32 on the plain build: the file's numbers)."""
    pytest.importorskip("localpaged.model.gguf_loader")  # the GGUF room's reader
    model, config = load_model(smollm_gguf, dtype="float32")
    assert config.architecture == "LlamaForCausalLM" and config.tie_word_embeddings
    ids = Tokenizer.from_pretrained(smollm_hf_dir).encode("The capital of France is")
    caches = model.allocate_kv_caches(2, 16, dtype=model.dtype)
    positions, meta = step_builder([([1], 0, len(ids))], 16)
    got = model.compute_logits(model(torch.tensor(ids), positions, caches, meta))
    torch.testing.assert_close(got, hf_logits(smollm_hf_dir, ids), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_smollm_gguf_keeps_q4_weights_4bit(smollm_gguf: Path, dtype: str) -> None:
    """A GGUF loads for the CPU's compute dtype (bf16 where it is native, else float32), and
    in float32 too, with its Q4_1 matrices still 4-bit on the own kernel."""
    from localpaged.quant import cpu_w4
    from localpaged.quant.linear import QuantLinear

    model, _ = load_model(smollm_gguf, dtype=dtype)
    assert model.dtype == (cpu_compute_dtype()[0] if dtype == "auto" else torch.float32)
    proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(proj, QuantLinear)
    if model.dtype == torch.float32:
        assert cpu_w4.available() and proj.w4_packed is not None and proj.qweight is None
