"""Decode steps through the native CPU layer (`localpaged.kernels.decode_layer`) against the
same model's torch layers: a 4-bit tiny Qwen2 (q/k/v biases, GQA) and the real SmolLM2, with
requests of different lengths in scattered blocks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from localpaged.kernels import AttentionMetadata, native
from localpaged.kernels.decode_layer import CpuDecodePlan
from localpaged.model.loader import load_model
from localpaged.model.optimize import optimize_for_inference

pytestmark = pytest.mark.skipif(not native.has_compiler(), reason="no C compiler here to build the CPU kernels")

BS = 16


def _decode_step_both_ways(model, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill each prompt (torch layers), then one decode step for all of them at once, run
    by the torch layers and by the native plan. Returns both steps' log-probabilities."""
    plan = model.cpu_decode
    model.cpu_decode = None
    order = [7, 2, 11, 0, 5, 9, 3, 12, 1, 8, 4, 10, 6, 13]  # scattered, non-consecutive
    caches = model.allocate_kv_caches(num_blocks=len(order), block_size=BS)
    tables, next_ids = [], []
    for ids in prompts:
        n = len(ids)
        blocks = [order.pop() for _ in range(n // BS + 1)]  # room for the decoded token
        tables.append(blocks)
        slots = torch.tensor([blocks[i // BS] * BS + i % BS for i in range(n)])
        meta = AttentionMetadata(
            slot_mapping=slots, block_tables=torch.tensor([blocks], dtype=torch.int32),
            seq_lens=torch.tensor([n], dtype=torch.int32),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32), max_query_len=n,
            max_seq_len=n)
        hidden = model(torch.tensor(ids), torch.arange(n), caches, meta)
        next_ids.append(int(model.compute_logits(hidden[-1:]).argmax()))
    width = max(len(t) for t in tables)
    lens = [len(ids) + 1 for ids in prompts]

    def step() -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([t[(n - 1) // BS] * BS + (n - 1) % BS
                                       for t, n in zip(tables, lens)]),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                      dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            query_start_loc=torch.arange(len(prompts) + 1, dtype=torch.int32), max_query_len=1,
            max_seq_len=max(lens))
        hidden = model(torch.tensor(next_ids), torch.tensor([n - 1 for n in lens]), caches, meta)
        return torch.log_softmax(model.compute_logits(hidden), -1)

    reference = step()
    model.cpu_decode = plan
    return reference, step()


# Largest log-prob gap of the top token between the two paths: bf16 rounding in a different
# order; in float32 only the order of summation.
GAP = {torch.bfloat16: 0.15, torch.float32: 1e-3}


def _assert_close(reference: torch.Tensor, native: torch.Tensor, dtype: torch.dtype) -> None:
    top = reference.argmax(-1)
    assert torch.equal(native.argmax(-1), top)
    gap = (native.gather(1, top[:, None]) - reference.gather(1, top[:, None])).abs().max()
    assert gap < GAP[dtype], gap
    probs = reference.exp()
    assert (probs * (native - reference)).abs().sum(-1).max() < 0.1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_native_decode_matches_the_torch_layers_on_a_4bit_qwen2(tiny_qwen2: Path,
                                                                 cpu_variant: str,
                                                                 dtype: torch.dtype,
                                                                to_4bit: Callable) -> None:
    model, _ = load_model(tiny_qwen2, dtype=dtype)
    to_4bit(model)
    optimize_for_inference(model, torch.device("cpu"))
    assert isinstance(model.cpu_decode, CpuDecodePlan)
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None  # biases on the path
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 16, 33)]
    _assert_close(*_decode_step_both_ways(model, prompts), dtype)


def test_plan_is_not_built_for_a_dense_checkpoint_or_without_the_kernel(
        tiny_qwen2: Path, monkeypatch: pytest.MonkeyPatch, to_4bit: Callable) -> None:
    model, _ = load_model(tiny_qwen2, dtype="float32")
    optimize_for_inference(model, torch.device("cpu"))
    assert model.cpu_decode is None
    monkeypatch.setenv("LOCALPAGED_CPU_KERNELS", "off")
    model, _ = load_model(tiny_qwen2, dtype="bfloat16")
    to_4bit(model)
    optimize_for_inference(model, torch.device("cpu"))
    assert model.cpu_decode is None


@pytest.mark.smollm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_native_decode_matches_the_torch_layers_on_smollm(smollm_gguf: Path, cpu_variant: str,
                                                           dtype: torch.dtype) -> None:
    model, _ = load_model(smollm_gguf, dtype=dtype)
    done = optimize_for_inference(model, torch.device("cpu"))
    assert done["native_decode"] == 1
    chat = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 30, 2, 198, 1, 4093, 198, 1780,
            314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]  # SmolLM2 chat prompt
    _assert_close(*_decode_step_both_ways(model, [chat, chat[:9], chat[:20]]), dtype)
