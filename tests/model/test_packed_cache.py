"""The packed-weights cache: a GGUF's second load maps what its first packed, computes the
same numbers, and a damaged, stale or over-budget entry never changes what a load gives."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from localpaged.model import packed_cache
from localpaged.model.gguf_loader import open_gguf
from localpaged.model.loader import load_inference_model as load_model

PROMPT = [504, 3575, 282, 4649, 314, 1000, 2000, 30]
BLOCK = 16


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "packed"
    monkeypatch.setenv(packed_cache.ENV_DIR, str(folder))
    monkeypatch.setenv(packed_cache.ENV_GB, "4")
    return folder


@pytest.fixture
def logits(step_builder: Callable) -> Callable[[torch.nn.Module], torch.Tensor]:
    return lambda model: prompt_logits(model, step_builder)


def prompt_logits(model: torch.nn.Module, step_builder: Callable) -> torch.Tensor:
    """PROMPT's logits through the model's layers, as one prefill step."""
    caches = model.allocate_kv_caches(2, BLOCK)
    positions, meta = step_builder([([1], 0, len(PROMPT))], BLOCK)
    ids = torch.tensor(PROMPT) % model.config.vocab_size  # tiny test models' vocabularies too
    with torch.no_grad():
        return model.compute_logits(model(ids, positions, caches, meta))


def test_second_load_maps_the_first_packing(smollm_gguf: Path, logits: Callable, cache: Path,
                                            capfd: pytest.CaptureFixture[str]) -> None:
    first, _ = load_model(smollm_gguf, dtype="float32")
    assert "keeping the packed weights for the next load" in capfd.readouterr().err
    packed_cache.wait_for_writes()
    [entry] = packed_cache.entries()
    assert entry.parent == cache and entry.stat().st_size > 50 * 2**20
    second, _ = load_model(smollm_gguf, dtype="float32")
    assert "mapped from" in capfd.readouterr().err
    assert type(second) is type(first)
    kinds = [type(m).__name__ for m in first.modules()]
    assert [type(m).__name__ for m in second.modules()] == kinds
    assert first.model.layers[0].self_attn.qkv_proj is not None  # joined before it was kept
    # Every tensor is equal, and the tied output layer still shares the embedding's storage.
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(logits(first), logits(second))


def test_damaged_entry_is_packed_again(smollm_gguf: Path, logits: Callable, cache: Path) -> None:
    reference, _ = load_model(smollm_gguf, dtype="float32")
    packed_cache.wait_for_writes()
    [entry] = packed_cache.entries()
    whole = entry.stat().st_size
    with open(entry, "r+b") as f:
        f.truncate(whole // 2)
    again, _ = load_model(smollm_gguf, dtype="float32")
    packed_cache.wait_for_writes()
    assert torch.equal(logits(reference), logits(again))
    [rewritten] = packed_cache.entries()
    assert rewritten.stat().st_size == whole  # the whole packing, written anew


def test_key_follows_dtype_build_and_settings(smollm_gguf: Path, cache: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    fp = open_gguf(smollm_gguf).fingerprint
    base = packed_cache.entry_key(fp, torch.float32)
    assert packed_cache.entry_key(fp, torch.float32) == base
    assert packed_cache.entry_key(fp, torch.bfloat16) != base
    assert packed_cache.entry_key(fp + "0", torch.float32) != base
    monkeypatch.setenv("LOCALPAGED_CPU_ISA", "generic")
    assert packed_cache.entry_key(fp, torch.float32) != base
    monkeypatch.delenv("LOCALPAGED_CPU_ISA")
    monkeypatch.setenv(packed_cache.ENV_GB, "3")  # where and how much: not what a load computes
    assert packed_cache.entry_key(fp, torch.float32) == base


def test_least_recently_used_entries_make_room(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(packed_cache.ENV_GB, str(3 * 2**20 / 2**30))  # 3 MiB
    blob = torch.nn.Linear(512, 512)  # 1 MiB of weights
    size = packed_cache.tensor_bytes(blob)
    paths = [packed_cache.save(blob, "m", key, size) for key in ("a", "b")]
    assert all(p is not None for p in paths)
    assert packed_cache.load("m", "a") is not None  # "a" is now the most recently used
    assert packed_cache.save(blob, "m", "c", size) is not None
    code = packed_cache.code_hash()[:8]
    assert {p.name for p in packed_cache.entries()} == {f"m-{code}-a.pt", f"m-{code}-c.pt"}
    assert packed_cache.save(blob, "m", "big", 4 * 2**20) is None  # over the whole limit


def test_off_writes_nothing(smollm_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(packed_cache.ENV_GB, "0")
    load_model(smollm_gguf, dtype="float32")
    packed_cache.wait_for_writes()
    assert packed_cache.entries() == []
    assert not cache.exists()


def test_unwritable_folder_only_skips_the_cache(smollm_gguf: Path, logits: Callable, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capfd: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(packed_cache.ENV_DIR, str(blocker / "packed"))
    monkeypatch.setenv(packed_cache.ENV_GB, "4")
    model, _ = load_model(smollm_gguf, dtype="float32")
    packed_cache.wait_for_writes()
    assert "not keeping packed weights" in capfd.readouterr().err
    assert logits(model).isfinite().all()


def test_changes_after_the_load_stay_out_of_the_file(smollm_gguf: Path, cache: Path,
                                                     logits: Callable) -> None:
    """The engine replaces parts of a loaded model (its decode plan, an int8 output layer)
    while the packed weights are written: the file holds the model as loaded."""
    first, _ = load_model(smollm_gguf, dtype="float32")
    head = first.lm_head
    first.lm_head = torch.nn.Identity()
    first.cpu_decode = object()  # not even picklable
    packed_cache.wait_for_writes()
    first.lm_head = head
    second, _ = load_model(smollm_gguf, dtype="float32")
    assert second.lm_head is not None and type(second.lm_head) is type(head)
    assert second.cpu_decode is None
    first.cpu_decode = None
    assert torch.equal(logits(first), logits(second))


def test_a_new_version_drops_the_older_ones_entries(cache: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    blob = torch.nn.Linear(64, 64)
    size = packed_cache.tensor_bytes(blob)
    old = packed_cache.save(blob, "m", "k1", size)
    other = packed_cache.save(blob, "n", "k1", size)
    monkeypatch.setattr(packed_cache, "_code_hash", "f" * 64)  # the package changed
    new = packed_cache.save(blob, "m", "k2", size)
    assert new is not None and new.exists() and other is not None and other.exists()
    assert old is not None and not old.exists()


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_a_quantized_folder_is_kept_too(tiny_llama: Path, tmp_path: Path, cache: Path,
                                        method: str, logits: Callable) -> None:
    """An AWQ / GPTQ checkpoint (repacked for the CPU kernels at load) is kept and mapped
    back like a GGUF; a 16-bit folder is loaded as it is, nothing kept."""
    from transformers import AutoModelForCausalLM

    from localpaged.quant.awq import awq_quantize
    from localpaged.quant.writer import save_quantized

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    layers = {f"model.layers.{n}": awq_quantize(m.weight.data, 32)
              for n, m in hf.model.layers.named_modules() if isinstance(m, torch.nn.Linear)}
    folder = save_quantized(hf, layers, tmp_path / f"tiny-{method}", method, 32, sym=False)
    first, _ = load_model(folder, dtype="float32")
    packed_cache.wait_for_writes()
    [entry] = packed_cache.entries()
    assert entry.name.startswith(f"tiny-{method}-")
    second, _ = load_model(folder, dtype="float32")
    assert torch.equal(logits(first), logits(second))
    load_model(tiny_llama, dtype="float32")
    packed_cache.wait_for_writes()
    assert packed_cache.entries() == [entry]


def test_a_load_on_a_daemon_thread_still_writes_before_the_process_ends(
        smollm_gguf: Path, tmp_path: Path) -> None:
    """The chat engine loads on a daemon thread, and a thread's children are daemons by
    default: a process ending right after its first load (a quick chat) was stopped mid-write
    (torch's C++ frames unwound: abort) and the entry never written. The writer waits."""
    import subprocess
    import sys

    code = (
        "import sys, threading\n"
        "from localpaged.model.loader import load_inference_model\n"
        "t = threading.Thread(target=load_inference_model, args=(sys.argv[1],), daemon=True)\n"
        "t.start(); t.join()\n"
    )
    env = {**__import__("os").environ, packed_cache.ENV_DIR: str(tmp_path), packed_cache.ENV_GB: "4"}
    done = subprocess.run([sys.executable, "-c", code, str(smollm_gguf)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [p.suffix for p in tmp_path.iterdir()] == [".pt"]  # written whole, no .tmp left
