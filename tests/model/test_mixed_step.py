"""A step that carries decodes and prompt chunks, on a model with the native CPU decode plan:
the decode rows get what a decode-only step gives them, the chunks what a prefill-only step
gives them (bit for bit), the KV cache the same writes, and all rows agree with the torch
layers running the whole step (the independent reference)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from localpaged.kernels import native
from localpaged.kernels.decode_layer import CpuDecodePlan
from localpaged.model import llama
from localpaged.model.loader import load_model
from localpaged.model.optimize import optimize_for_inference

pytestmark = pytest.mark.skipif(not native.has_compiler(),
                                reason="no C compiler here to build the CPU kernels")

BS = 4
# (name, cached tokens, new tokens) of each request in the mixed step, in the step's order:
# prompt chunks (one after a cached prefix, one fresh) between decode rows.
MIXED = [("C", 16, 13), ("A", 20, 1), ("D", 0, 11), ("B", 9, 1), ("E", 6, 1)]
DECODES = ["A", "B", "E"]
CHUNKS = ["C", "D"]


class Steps:
    """Runs steps of `model` over fixed token streams, one block table per request."""

    def __init__(self, model: torch.nn.Module, step_builder: Callable, vocab: int) -> None:
        self.model, self.make = model, step_builder
        g = torch.Generator().manual_seed(0)
        self.ids = {name: torch.randint(3, vocab, (40,), generator=g).tolist()
                    for name, _, _ in MIXED}
        blocks = torch.randperm(64, generator=g).tolist()  # scattered blocks
        self.tables = {name: [blocks.pop() for _ in range(10)] for name, _, _ in MIXED}
        self.caches = model.allocate_kv_caches(num_blocks=64, block_size=BS)

    def run(self, seqs: list[tuple[str, int, int]], caches: list) -> torch.Tensor:
        """Hidden rows [T, hidden] of one step of `seqs`, written into `caches`."""
        positions, meta = self.make([(self.tables[n], c, k) for n, c, k in seqs], BS)
        ids = torch.tensor([t for n, c, k in seqs for t in self.ids[n][c:c + k]])
        return self.model(ids, positions, caches, meta)

    def fill(self) -> None:
        """Compute every request's cached tokens (prefill-only steps)."""
        for name, cached, _ in MIXED:
            if cached:
                self.run([(name, 0, cached)], self.caches)

    def copy(self) -> list:
        return [(k.clone(), v.clone()) for k, v in self.caches]


def _rows(names: list[str]) -> list[int]:
    """The flat rows of `names`' tokens in the mixed step."""
    rows, at = [], 0
    for name, _, new in MIXED:
        if name in names:
            rows.extend(range(at, at + new))
        at += new
    return rows


def _check_mixed_step(model: torch.nn.Module, step_builder: Callable) -> None:
    assert isinstance(model.cpu_decode, CpuDecodePlan)
    steps = Steps(model, step_builder, model.config.vocab_size)
    steps.fill()
    mixed_caches, split_caches, torch_caches = steps.copy(), steps.copy(), steps.copy()
    mixed = steps.run(MIXED, mixed_caches)
    decode_only = steps.run([s for s in MIXED if s[0] in DECODES], split_caches)
    prefill_only = steps.run([s for s in MIXED if s[0] in CHUNKS], split_caches)
    dec, pre = _rows(DECODES), _rows(CHUNKS)
    assert torch.equal(mixed[dec], decode_only)
    assert torch.equal(mixed[pre], prefill_only)
    for (k, v), (k2, v2) in zip(mixed_caches, split_caches, strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    # The reference: the torch layers run the whole step.
    plan, model.cpu_decode = model.cpu_decode, None
    try:
        reference = steps.run(MIXED, torch_caches)
    finally:
        model.cpu_decode = plan
    ours = torch.log_softmax(model.compute_logits(mixed), -1)
    ref = torch.log_softmax(model.compute_logits(reference), -1)
    top = ref.argmax(-1)
    gap = (ours.gather(1, top[:, None]) - ref.gather(1, top[:, None])).abs().max()
    # bf16, or float32 with int8 activations (a last-bit difference can move a code by a
    # step): rounding noise; plain float32: the order of sums only.
    from localpaged.quant import cpu_w4

    noisy = model.dtype == torch.bfloat16 or cpu_w4.int8_activations()
    int8 = model.dtype == torch.float32 and noisy
    tolerance = 0.4 if int8 else 0.15 if noisy else 1e-3  # int8: see test_optimize
    assert gap < tolerance, gap
    # The same top token, except at a near-tie of the reference (within the tolerance).
    picked = ours.argmax(-1)
    ties = ref.gather(1, top[:, None]) - ref.gather(1, picked[:, None])
    assert bool((ties[picked != top] < tolerance).all()), ties[picked != top]
    # The torch reference differs from the native path only in the order of sums, so the
    # decode rows' KV is close to it; the chunks' rows are the same computation.
    for (k, v), (k2, v2) in zip(mixed_caches, torch_caches, strict=True):
        if model.dtype == torch.float32 and noisy:
            # int8: a last-bit difference moves a code by one step, and that grows over the
            # layers (single entries up to 0.3, a layer's whole cache up to 1.1% on SmolLM2,
            # AVX2; layer 0 equal to 3e-7)
            for a, b in ((k, k2), (v, v2)):
                assert (a - b).norm() <= 0.03 * b.norm()
            continue
        tol = dict(atol=0.1, rtol=0.05) if noisy else dict(atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(k, k2, **tol)
        torch.testing.assert_close(v, v2, **tol)


@pytest.mark.parametrize(("native_max", "max_attention", "torch_rows"),
                         [(64, 32768, 0), (8, 32768, 24), (64, 200, 13)],
                         ids=["chunks-native", "chunks-torch", "long-context-chunk-torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_mixed_step_splits_decodes_and_chunks_on_a_4bit_qwen2(
        tiny_qwen2: Path, step_builder: Callable, to_4bit: Callable, dtype: torch.dtype,
        native_max: int, max_attention: int, torch_rows: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks within `native_limits` through the native plan (one row per token): up to its
    tokens, unless their tokens times their context pass its second limit (C: 13 x 29, D:
    11 x 11); longer ones through the torch layers: all exact against their own steps."""
    for each in (torch.bfloat16, torch.float32):  # bf16 without AMX takes float32's limits
        monkeypatch.setitem(llama.NATIVE_LIMITS, each, (native_max, max_attention))
    model, _ = load_model(tiny_qwen2, dtype=dtype)
    to_4bit(model)
    optimize_for_inference(model, torch.device("cpu"))
    seen: list[int] = []
    run_layers = model._run_layers

    def spy(h: torch.Tensor, *args: object) -> object:
        seen.append(h.shape[0])
        return run_layers(h, *args)

    monkeypatch.setattr(model, "_run_layers", spy)
    _check_mixed_step(model, step_builder)
    # The torch layers' batches (filling the prefixes, the steps, the reference's 29 rows):
    # the chunks they took in the mixed and prefill-only steps, or none of them.
    chunk_batches = {n for n in seen if n in (11, 13, 24)}
    assert chunk_batches == ({torch_rows} if torch_rows else set()), seen


@pytest.mark.smollm
def test_mixed_step_splits_decodes_and_chunks_on_smollm(smollm_gguf: Path,
                                                        step_builder: Callable) -> None:
    model, _ = load_model(smollm_gguf, dtype=torch.float32)
    optimize_for_inference(model, torch.device("cpu"))
    _check_mixed_step(model, step_builder)


@pytest.mark.parametrize(("isa", "dtype", "limits"), [
    ("amx", torch.bfloat16, llama.NATIVE_LIMITS[torch.bfloat16]),
    ("avx512bf16", torch.bfloat16, llama.NATIVE_LIMITS[torch.float32]),
    ("amx", torch.float32, llama.NATIVE_LIMITS[torch.float32]),
    ("avx2", torch.float32, llama.NATIVE_LIMITS[torch.float32])])
def test_bf16_chunks_stay_short_only_where_torch_attention_has_amx(
        isa: str, dtype: torch.dtype, limits: tuple[int, int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from localpaged.kernels import cpu_isa

    monkeypatch.setattr(cpu_isa, "chosen", lambda: isa)
    assert llama.native_limits(dtype) == limits
