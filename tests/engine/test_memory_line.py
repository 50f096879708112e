"""The load line of what the engine holds: weights (each storage once), KV cache, the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

from localpaged.engine.config import EngineArgs
from localpaged.engine.engine import LLMEngine
from localpaged.engine.loading import memory_line, resident_bytes, weights_bytes


def test_the_engine_says_what_it_holds(tiny_llama: Path, capsys: pytest.CaptureFixture) -> None:
    engine = LLMEngine.from_args(EngineArgs(model=str(tiny_llama), dtype="float32",
                                            kv_cache_gb=0.01))
    err = capsys.readouterr().err
    model = engine.model
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    extra = sum(b.numel() * b.element_size() for b in model.buffers())  # rotary tables
    assert weights_bytes(model) == dense + extra
    assert engine.weights_bytes == weights_bytes(model)
    tokens = engine.kv_bytes // model.kv_cache_bytes_per_block(engine.args.block_size) \
        * engine.args.block_size
    line = memory_line(engine.weights_bytes, engine.kv_bytes, tokens, None)
    assert line in err and f"KV cache 0.01 GiB ({tokens} tokens)" in line
    resident = resident_bytes()
    assert resident is None or resident > engine.kv_bytes


def test_a_tied_storage_counts_once() -> None:
    import torch

    linear = torch.nn.Linear(8, 16, bias=False)
    model = torch.nn.Sequential(linear, torch.nn.Linear(8, 16, bias=False))
    model[1].weight = linear.weight  # tied
    assert weights_bytes(model) == 8 * 16 * 4
