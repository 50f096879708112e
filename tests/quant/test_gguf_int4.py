"""GGUF Q4_0/Q4_1 matrices kept 4-bit (the GGUF reader's `int4_weights`, our layout and
`QuantLinear`) give the logits of the same GGUF dequantized to float32 at load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from localpaged.kernels import AttentionMetadata
from localpaged.model.config import ModelConfig
from localpaged.model.loader import build_model
from localpaged.quant.linear import QuantLinear


def _logits(model, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    caches = model.allocate_kv_caches(num_blocks=-(-n // 16), block_size=16, dtype=model.dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), block_tables=torch.arange(-(-n // 16)).view(1, -1).int(),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), max_query_len=n, max_seq_len=n)
    return model.compute_logits(model(torch.tensor(ids), torch.arange(n), caches, meta))


@pytest.mark.smollm
def test_gguf_q4_kept_4bit_matches_dense(smollm_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The 4-bit layers hold the file's numbers: on the plain build, whose float32 path has
    no int8 activations, the logits equal the dense model's up to float32 rounding (the
    int8-activation builds are held to float32 by test_optimize's SmolLM2 test)."""
    from localpaged.kernels import cpu_isa
    from localpaged.model.gguf_loader import open_gguf

    monkeypatch.setenv(cpu_isa.ENV, "generic")

    f = open_gguf(smollm_gguf)
    config = ModelConfig.from_dict(f.hf_config())
    dense = build_model(config, f.weights(), torch.float32)
    packed = build_model(config, f.int4_weights(), torch.float32)
    n_quant = sum(isinstance(m, QuantLinear) for m in packed.modules())
    assert n_quant >= 7 * config.num_layers // 2
    ids = list(range(100, 124))
    torch.testing.assert_close(_logits(packed, ids), _logits(dense, ids), atol=2e-3, rtol=1e-3)
