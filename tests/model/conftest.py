"""Helpers for the model tests: hand-built attention metadata and HF reference logits."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from localpaged.kernels import AttentionMetadata

# One sequence's part of a step: (block_table, num_cached_tokens, num_new_tokens).
SeqStep = tuple[list[int], int, int]


def make_step(seqs: list[SeqStep], block_size: int) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions [T] and AttentionMetadata for a flat batch of the given sequences."""
    positions, slots, seq_lens, qsl = [], [], [], [0]
    for table, cached, new in seqs:
        for p in range(cached, cached + new):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        seq_lens.append(cached + new)
        qsl.append(qsl[-1] + new)
    width = max(len(t) for t, _, _ in seqs)
    tables = [t + [0] * (width - len(t)) for t, _, _ in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        max_query_len=max(n for _, _, n in seqs),
        max_seq_len=max(seq_lens),
    )
    return torch.tensor(positions, dtype=torch.int64), meta


@pytest.fixture(scope="session")
def step_builder() -> Callable[[list[SeqStep], int], tuple[torch.Tensor, AttentionMetadata]]:
    return make_step


@pytest.fixture(scope="session")
def hf_logits() -> Callable[[Path, list[int]], torch.Tensor]:
    """Full-sequence float32 logits [L, vocab] of the HF model in `folder` (fp32, CPU)."""
    from transformers import AutoModelForCausalLM

    models: dict[Path, torch.nn.Module] = {}

    def run(folder: Path, ids: list[int]) -> torch.Tensor:
        if folder not in models:
            models[folder] = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            return models[folder](torch.tensor([ids])).logits[0].float()

    return run
