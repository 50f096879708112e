"""Sampler: filters and penalties against transformers' logits processors, seeded draws."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from localpaged import LLM, SamplingParams
from localpaged.engine.sampler import SamplingRow, _apply_penalties, _filter, make_generator, sample


def hf_filtered(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    x = TemperatureLogitsWarper(p.temperature)(None, logits[None].clone())
    if p.top_k > 0:
        x = TopKLogitsWarper(p.top_k)(None, x)
    if p.top_p < 1:
        x = TopPLogitsWarper(p.top_p)(None, x)
    if p.min_p > 0:
        x = MinPLogitsWarper(p.min_p)(None, x)
    return x[0]


@pytest.mark.parametrize("kw", [
    {"top_k": 5}, {"top_p": 0.5}, {"top_p": 0.9, "temperature": 0.7}, {"min_p": 0.1},
    {"top_k": 20, "top_p": 0.8, "min_p": 0.05, "temperature": 1.3},
])
def test_filters_keep_the_same_tokens_as_transformers(kw: dict) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(200, generator=g) * 3
        p = SamplingParams(**kw)
        ours = torch.isfinite(_filter(logits / p.temperature, p))
        theirs = torch.isfinite(hf_filtered(logits, p))
        assert torch.equal(ours, theirs)


def test_repetition_penalty_matches_transformers() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    prompt, output = [1, 2, 3, 3], [7, 1]
    p = SamplingParams(repetition_penalty=1.3)
    ours = _apply_penalties(logits.clone(), SamplingRow(p, prompt, output, None))
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits[None].clone())[0]
    assert torch.allclose(ours, theirs)


def test_presence_and_frequency_penalties_follow_openai_formula() -> None:
    logits = torch.zeros(10)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = _apply_penalties(logits.clone(), SamplingRow(p, [4], [1, 1, 1, 2], None))
    expected = torch.zeros(10)
    expected[1] = -(3 * 0.25 + 0.5)
    expected[2] = -(0.25 + 0.5)
    assert torch.allclose(out, expected)  # prompt token 4 untouched


def test_draws_follow_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    p = SamplingParams(temperature=1.0)
    g = make_generator(123)
    counts = torch.zeros(4)
    for _ in range(3000):
        tok, _ = sample(logits[None], [SamplingRow(p, [0], [], g)])
        counts[tok[0]] += 1
    assert torch.allclose(counts / 3000, probs, atol=0.03)


def test_logprobs_top_n() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    tokens, lps = sample(logits, [SamplingRow(SamplingParams(temperature=0, logprobs=2), [0], [], None)])
    ref = torch.log_softmax(logits[0], -1)
    assert tokens == [1]
    assert lps[0].logprob == pytest.approx(ref[1].item())
    assert [t for t, _ in lps[0].top] == [1, 2]


def test_seeded_request_gives_the_same_tokens_whatever_is_batched(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32")
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=42, max_tokens=12, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": [5, 6, 7]}, seeded)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": list(range(10, 10 + n))} for n in (3, 20, 40)]
    batch = llm.generate([*others, {"prompt_token_ids": [5, 6, 7]}],
                         [SamplingParams(temperature=1.0, max_tokens=12)] * 3 + [seeded])
    assert batch[-1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_tokens=12, ignore_eos=True)
    assert llm.generate({"prompt_token_ids": [5, 6, 7]}, other_seed)[0].outputs[0].token_ids != alone


def test_top_k_one_is_greedy_and_stop_token_ids_end_the_answer(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32")
    prompt = {"prompt_token_ids": [9, 8, 7, 6]}
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    topk1 = llm.generate(prompt, SamplingParams(temperature=0.8, top_k=1, max_tokens=8,
                                                ignore_eos=True))
    ids = greedy[0].outputs[0].token_ids
    assert topk1[0].outputs[0].token_ids == ids
    stopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                  stop_token_ids=[ids[3]]))[0].outputs[0]
    assert stopped.token_ids == ids[:ids.index(ids[3]) + 1]
    assert stopped.finish_reason == "stop"
    assert greedy[0].outputs[0].finish_reason == "length"


def test_greedy_batch_picks_each_rows_first_maximum_as_argmax_does() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1000, generator=g)
    logits[1, 7] = logits[1, 700] = 50.0  # a tie: the first index wins
    logits[3, 999] = 60.0
    rows = [SamplingRow(SamplingParams(temperature=0), [0], [], None) for _ in range(5)]
    tokens, logprobs = sample(logits, rows)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert tokens[1] == 7 and tokens[3] == 999 and logprobs is None
