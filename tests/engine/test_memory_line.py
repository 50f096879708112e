"""The load line of what the engine holds: weights (each storage once), KV cache, the rest."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

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
    # a float32 model on the CPU keeps a float16 cache: the pool holds twice the tokens
    assert engine.runner.kv_caches[0][0].dtype == torch.float16
    c = model.config
    assert model.kv_cache_bytes_per_block(16) == 2 * 16 * c.num_kv_heads * c.head_dim * 2 \
        * c.num_layers
    assert f"KV cache up to 0.01 GiB (float16, {tokens} tokens, taken as used)" in err
    assert memory_line(engine.weights_bytes, engine.kv_bytes, tokens, None, "float16") == (
        f"memory: weights {engine.weights_bytes / 2**30:.2f} GiB, KV cache 0.01 GiB "
        f"(float16, {tokens} tokens)")
    assert resident_bytes() is None or resident_bytes() > engine.weights_bytes


def test_the_kv_cache_dtype_is_chosen_or_refused_clearly(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pinned on the CPU kernels: the pool holds that type and its bytes follow. On the Triton
    kernels (the CPU interpreter here, CUDA for users) another type than the model's is refused
    before anything is allocated."""
    pinned = LLMEngine.from_args(EngineArgs(model=str(tiny_llama), dtype="float32",
                                            kv_cache_gb=0.01, kv_cache_dtype="float32"))
    assert pinned.runner.kv_caches[0][0].dtype == torch.float32
    c = pinned.model.config
    assert pinned.kv_bytes == pinned.runner.kv_caches[0][0].shape[0] * 2 * 16 * c.num_kv_heads * c.head_dim * 4 \
        * c.num_layers
    with pytest.raises(ValueError, match="kv_cache_dtype='bf16' is invalid"):
        EngineArgs(model="m", kv_cache_dtype="bf16")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("LOCALPAGED_KERNELS", "triton")
    with pytest.raises(ValueError, match="the Triton kernels keep the cache in the model's dtype"):
        LLMEngine.from_args(EngineArgs(model=str(tiny_llama), dtype="float32", kv_cache_gb=0.01,
                                       kv_cache_dtype="float16"))


def test_the_cpu_kv_pool_takes_memory_as_it_is_written(tiny_llama: Path) -> None:
    """A 1 GiB pool costs no resident memory until blocks are written, then about what was
    written (pages of the blocks the requests took)."""
    resident = resident_bytes()
    if resident is None:
        pytest.skip("this OS does not report resident memory through /proc")
    engine = LLMEngine.from_args(EngineArgs(model=str(tiny_llama), dtype="float32",
                                            kv_cache_gb=1.0))
    assert engine.kv_bytes > 0.9 * 2**30
    after_load = resident_bytes()
    assert after_load - resident < 0.25 * engine.kv_bytes
    caches = engine.runner.kv_caches
    for k, v in caches:
        k.fill_(1.0)
        v.fill_(1.0)
    assert resident_bytes() - after_load > 0.9 * engine.kv_bytes


def test_the_cpu_kv_pool_is_sized_from_available_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from localpaged.engine import config

    monkeypatch.setattr(config, "available_memory", lambda: 16 * 2**30)
    assert EngineArgs(model="m", device="cpu").resolved_kv_cache_gb() == 4.0
    monkeypatch.setattr(config, "available_memory", lambda: 2**29)
    assert EngineArgs(model="m", device="cpu").resolved_kv_cache_gb() == config.CPU_KV_MIN_GB
    monkeypatch.setattr(config, "available_memory", lambda: None)
    assert EngineArgs(model="m", device="cpu").resolved_kv_cache_gb() == config.CPU_KV_FALLBACK_GB
    assert EngineArgs(model="m", device="cpu", kv_cache_gb=0.5).resolved_kv_cache_gb() == 0.5
    assert config.available_memory() is None or config.available_memory() > 0


def test_a_tied_storage_counts_once() -> None:
    linear = torch.nn.Linear(8, 16, bias=False)
    model = torch.nn.Sequential(linear, torch.nn.Linear(8, 16, bias=False))
    model[1].weight = linear.weight  # tied
    assert weights_bytes(model) == 8 * 16 * 4
