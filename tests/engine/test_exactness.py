"""The engine against transformers (fp32, CPU): greedy tokens and logprobs equal to HF's,
through chunked prefill, prefix-cache hits and preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from localpaged import LLM, SamplingParams

MAX_NEW = 10


def prompts(n: int = 8, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lengths = [1, 5, 15, 16, 17, 33, 48, 70][:n]
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]


def hf_greedy(folder: Path, batch: list[list[int]], max_new: int = MAX_NEW,
              **load: object) -> tuple[list[list[int]], list[list[float]]]:
    """transformers.generate, one prompt at a time: tokens and the logprob of each. `load`:
    more from_pretrained arguments (e.g. attn_implementation)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **load).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    tokens, logprobs = [], []
    for p in batch:
        out = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new,
                             min_new_tokens=max_new, output_scores=True,
                             return_dict_in_generate=True)
        new = out.sequences[0, len(p):].tolist()
        tokens.append(new)
        logprobs.append([torch.log_softmax(s[0].float(), -1)[t].item()
                         for s, t in zip(out.scores, new)])
    return tokens, logprobs


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_qwen3_moe"])
def model_and_reference(request: pytest.FixtureRequest) -> tuple[Path, list, list, list]:
    folder = request.getfixturevalue(request.param)
    batch = prompts()
    ref_tokens, ref_logprobs = hf_greedy(folder, batch)
    return folder, batch, ref_tokens, ref_logprobs


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)


def check(outs: list, ref_tokens: list, ref_logprobs: list) -> None:
    for out, toks, lps in zip(outs, ref_tokens, ref_logprobs):
        assert out.outputs[0].token_ids == toks
        ours = [lp.logprob for lp in out.outputs[0].logprobs]
        assert ours == pytest.approx(lps, abs=2e-4)


def test_batched_chunked_prefill_matches_transformers(model_and_reference: tuple) -> None:
    folder, batch, ref_tokens, ref_logprobs = model_and_reference
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=32, block_size=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)
    check(outs, ref_tokens, ref_logprobs)
    # Submitted again: leading blocks come from the prefix cache, tokens stay the same.
    before = llm.engine.stats().prefix_cache_hits
    again = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)
    check(again, ref_tokens, ref_logprobs)
    assert llm.engine.stats().prefix_cache_hits > before
    assert sum(o.num_cached_tokens for o in again) >= 16 * 6


def test_preemption_gives_the_same_tokens(model_and_reference: tuple) -> None:
    folder, batch, ref_tokens, ref_logprobs = model_and_reference
    # 12 blocks of 4 tokens: far too few for all 8 requests at once (they need ~70).
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=64, block_size=4,
              num_kv_blocks=24, enable_prefix_caching=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)
    assert llm.engine.stats().num_preemptions > 0
    check(outs, ref_tokens, ref_logprobs)


def test_follow_up_turns_compute_only_new_tokens(tiny_llama: Path) -> None:
    """Each turn reuses every token of the history before it whose K/V was computed: full
    blocks from the prefix cache, then the part-filled block the last turn left (taken over
    and written on after its kept tokens), and its answer equals transformers'."""
    llm = LLM(str(tiny_llama), dtype="float32", block_size=16)
    turn = prompts()[6]  # 48 tokens
    out = llm.generate({"prompt_token_ids": turn}, GREEDY)[0]
    for new_tokens in (list(range(100, 120)), list(range(200, 205))):
        history = turn + out.outputs[0].token_ids  # the answer's last token never fed back
        turn = history + new_tokens
        computed_before = llm.engine.stats().prompt_tokens_total
        out = llm.generate({"prompt_token_ids": turn}, GREEDY)[0]
        computed = llm.engine.stats().prompt_tokens_total - computed_before
        assert out.num_cached_tokens == len(history) - 1  # 57, then 87: not 48 and 80
        assert computed == len(turn) - (len(history) - 1)
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama, [turn])[0][0]


def test_bad_input_raises_before_scheduling_and_engine_keeps_serving(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=64)
    ok = {"prompt_token_ids": [5, 6, 7]}
    cases = [
        ({"prompt_token_ids": []}, SamplingParams(), "prompt"),
        ({"prompt_token_ids": list(range(3, 70))}, SamplingParams(), "too long"),
        ({"prompt_token_ids": [10_000]}, SamplingParams(), "out of range"),
    ]
    for prompt, params, word in cases:
        with pytest.raises(ValueError, match=word):
            llm.generate([ok, prompt], params)
        assert not llm.engine.has_unfinished_requests()
    for field, kwargs in [("max_tokens", {"max_tokens": 0}), ("temperature", {"temperature": -1}),
                          ("top_p", {"top_p": 0}), ("top_p", {"top_p": 1.5})]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    out = llm.generate(ok, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_requests_sharing_a_prefix_compute_it_once_together(model_and_reference: tuple) -> None:
    """Four chats sent together with one 96-token prefix: the prefix is computed once (each
    chunk by one of them, the others take it from the cache as they reach it), and every
    answer equals transformers'."""
    folder = model_and_reference[0]
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, 512, (96,), generator=g).tolist()
    batch = [prefix + torch.randint(3, 512, (5,), generator=g).tolist() for _ in range(4)]
    ref_tokens, ref_logprobs = hf_greedy(folder, batch)
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=64, block_size=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)
    check(outs, ref_tokens, ref_logprobs)
    computed = llm.engine.stats().prompt_tokens_total
    assert computed <= 96 + 4 * 5 + 3 * 16, computed  # not 4 x 101
    assert sum(o.num_cached_tokens for o in outs) >= 3 * 80


def test_chunks_cut_by_the_step_bound_give_the_same_tokens(model_and_reference: tuple) -> None:
    """A tiny step target: every step that carries a decode reads one block of one prompt
    only, so prompts are read in other chunks than without the bound. Same tokens."""
    folder, batch, ref_tokens, ref_logprobs = model_and_reference
    steps = {}
    for max_step_ms in (0, 1e-3):
        llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=64, block_size=4,
                  max_step_ms=max_step_ms)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)
        check(outs, ref_tokens, ref_logprobs)
        steps[max_step_ms] = llm.engine.steps
    assert steps[1e-3] > steps[0]
    # Offline batches read prompts at the whole budget unless a bound is asked for.
    assert LLM(str(folder), dtype="float32").engine.scheduler.time_bound is None


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_embeddings_equal_transformers_and_batch_with_generation(
        fixture: str, request: pytest.FixtureRequest) -> None:
    """Embedding requests (the normalized last-token hidden state) beside generating ones in
    the same steps: each vector is transformers' base model's (cosine >= 0.9999), a prompt
    whose prefix is cached gets the same vector, and the generation's tokens are unchanged."""
    from transformers import AutoModel

    folder = request.getfixturevalue(fixture)
    batch = prompts(6)
    llm = LLM(str(folder), dtype="float32", block_size=16, max_num_batched_tokens=32)
    alone = llm.generate([{"prompt_token_ids": p} for p in batch[:3]], GREEDY)
    vectors = llm.embed([{"prompt_token_ids": p} for p in batch])
    engine = llm.engine
    rids = [engine.add_request(p, GREEDY).request_id for p in batch[:3]]
    embed_ids = [engine.add_request(p, SamplingParams(max_tokens=1, embed=True)).request_id
                 for p in batch]
    tokens: dict[str, list[int]] = {r: [] for r in rids}
    mixed: dict[str, list[float]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.embedding is not None:
                mixed[out.request_id] = out.embedding
            elif out.request_id in tokens:
                tokens[out.request_id] += out.new_token_ids
    assert [tokens[r] for r in rids] == [o.outputs[0].token_ids for o in alone]
    hf = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    for p, v, rid in zip(batch, vectors, embed_ids, strict=True):
        with torch.no_grad():
            ref = torch.nn.functional.normalize(hf(torch.tensor([p])).last_hidden_state[0, -1], dim=-1)
        assert float(torch.dot(torch.tensor(v), ref)) >= 0.9999
        assert float(torch.dot(torch.tensor(mixed[rid]), ref)) >= 0.9999  # from the cache
