"""`optimize_for_inference`: fused projections compute what the separate ones did; on the
CPU in 16-bit, a 4-bit model's dense copies (wide batches) and int8 lm_head (narrow ones)
stay close to the plain 4-bit model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from localpaged.kernels import AttentionMetadata
from localpaged.model.loader import load_model
from localpaged.model.optimize import optimize_for_inference
from localpaged.quant import cpu_w4
from localpaged.quant.int8_linear import Int8Linear
from localpaged.quant.linear import QuantLinear


def _hidden(model, ids: list[int]) -> torch.Tensor:
    """Hidden states of one prompt run as a single prefill."""
    n = len(ids)
    blocks = -(-n // 16)
    caches = model.allocate_kv_caches(num_blocks=blocks, block_size=16)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), block_tables=torch.arange(blocks).view(1, -1).int(),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), max_query_len=n, max_seq_len=n)
    return model(torch.tensor(ids), torch.arange(n), caches, meta)


def test_fused_projections_compute_the_same_logits(tiny_qwen2: Path) -> None:
    model, _ = load_model(tiny_qwen2, dtype="float32")
    ids = list(range(3, 40))
    before = model.compute_logits(_hidden(model, ids))
    done = optimize_for_inference(model, torch.device("cpu"))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.qkv_proj is not None and mlp.gate_up_proj is not None
    assert not hasattr(attn, "q_proj") and not hasattr(mlp, "up_proj")
    assert done["dense_copies"] == 0 and done["int8_lm_head"] == 0  # float32: nothing else
    torch.testing.assert_close(model.compute_logits(_hidden(model, ids)), before,
                               rtol=1e-5, atol=1e-5)
    optimize_for_inference(model, torch.device("cpu"))  # a second call changes nothing
    torch.testing.assert_close(model.compute_logits(_hidden(model, ids)), before,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.smollm
def test_optimized_4bit_smollm_stays_close_to_the_plain_4bit_model(
        smollm_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALPAGED_CPU_KERNELS", "off")  # the reference: torch's int4 op only
    plain, _ = load_model(smollm_gguf)  # auto: bfloat16 compute, Q4_1 matrices kept 4-bit
    monkeypatch.delenv("LOCALPAGED_CPU_KERNELS")
    fast, _ = load_model(smollm_gguf)
    done = optimize_for_inference(fast, torch.device("cpu"))
    layers = 2 * 30 + 30 + 30  # qkv, o, gate_up, down per layer
    if cpu_w4.available():  # the own kernel serves every batch, decode steps natively
        assert done["native_decode"] == 1
        assert done["single_row_copies"] == 0 and done["dense_copies"] == 0
    else:
        assert done["dense_copies"] == layers
    assert done["int8_lm_head"] == 1 and isinstance(fast.lm_head, Int8Linear)
    assert isinstance(fast.model.layers[0].self_attn.qkv_proj, QuantLinear)

    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 30, 2, 198, 1, 4093, 198, 1780,
           314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]  # SmolLM2 chat prompt
    ref = torch.log_softmax(plain.compute_logits(_hidden(plain, ids)), -1)
    hidden = _hidden(fast, ids)  # 28 rows: the own kernel (or the dense copies)
    wide = torch.log_softmax(fast.compute_logits(hidden), -1)  # 28 rows: the dense head
    narrow = torch.log_softmax(torch.cat([fast.compute_logits(h[None]) for h in hidden]), -1)
    for got in (wide, narrow):  # narrow: one row at a time, the int8 head
        top = ref.argmax(-1)
        agree = (got.argmax(-1) == top).float().mean().item()
        assert agree >= 0.9, agree
        gap = (got.gather(1, top[:, None]) - ref.gather(1, top[:, None])).abs().max().item()
        assert gap < 0.35, gap
    assert ref[-1].argmax() == narrow[-1].argmax()  # the next token of the answer
