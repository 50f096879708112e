"""Our paged, flat-batch model against transformers (fp32, CPU): prefill, chunked prefill over
a scattered block table, token-by-token decode, and a mixed batch in one forward."""

from __future__ import annotations

import pytest
import torch

from localpaged.model.loader import load_model

BLOCK = 8
ATOL = 1e-5


@pytest.fixture(params=["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def tiny(request: pytest.FixtureRequest):
    return request.getfixturevalue(request.param)


def _ids(n: int, seed: int, vocab: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _run(model, caches, ids, seqs, step_builder) -> torch.Tensor:
    positions, meta = step_builder(seqs, BLOCK)
    hidden = model(torch.tensor(ids), positions, caches, meta)
    return model.compute_logits(hidden)


def test_prefill_matches_hf(tiny, step_builder, hf_logits) -> None:
    model, config = load_model(tiny)
    assert model.dtype == torch.float32
    ids = _ids(21, 0)
    caches = model.allocate_kv_caches(num_blocks=6, block_size=BLOCK, dtype=model.dtype)
    logits = _run(model, caches, ids, [([3, 1, 5], 0, len(ids))], step_builder)
    assert logits.dtype == torch.float32 and logits.shape == (21, config.vocab_size)
    torch.testing.assert_close(logits, hf_logits(tiny, ids), atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode(tiny, step_builder, hf_logits) -> None:
    """Two prefill chunks and single-token decodes over blocks that are neither contiguous
    nor in order; every position's logits equal HF's full-sequence ones."""
    model, _ = load_model(tiny)
    ids = _ids(37, 1)
    ref = hf_logits(tiny, ids)
    table = [9, 2, 7, 0, 4]  # 5 blocks of 8 hold 37 tokens
    caches = model.allocate_kv_caches(num_blocks=10, block_size=BLOCK, dtype=model.dtype)
    got = [_run(model, caches, ids[:13], [(table, 0, 13)], step_builder)]
    got.append(_run(model, caches, ids[13:30], [(table, 13, 17)], step_builder))
    for p in range(30, 37):
        got.append(_run(model, caches, ids[p : p + 1], [(table, p, 1)], step_builder))
    torch.testing.assert_close(torch.cat(got), ref, atol=ATOL, rtol=0)


def test_a_float16_cache_keeps_hf_logits_within_its_rounding(tiny, step_builder,
                                                             hf_logits) -> None:
    """The cache a float32 model keeps on the CPU by default (float16): the same chunked
    prefill and decodes as above, every position's logits within a few thousandths of HF's
    and the same greedy token."""
    model, _ = load_model(tiny)
    assert model.kv_cache_dtype() == torch.float16
    ids = _ids(37, 1)
    ref = hf_logits(tiny, ids)
    table = [9, 2, 7, 0, 4]
    caches = model.allocate_kv_caches(num_blocks=10, block_size=BLOCK)
    assert caches[0][0].dtype == torch.float16
    got = [_run(model, caches, ids[:13], [(table, 0, 13)], step_builder)]
    got.append(_run(model, caches, ids[13:30], [(table, 13, 17)], step_builder))
    for p in range(30, 37):
        got.append(_run(model, caches, ids[p : p + 1], [(table, p, 1)], step_builder))
    got = torch.cat(got)
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=0)
    assert not torch.allclose(got, ref, atol=ATOL, rtol=0)  # the rounding is there
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_mixed_batch_in_one_forward(tiny, step_builder, hf_logits) -> None:
    """One flat step holding a decode, a second prefill chunk and a fresh prefill."""
    model, _ = load_model(tiny)
    a, b, c = _ids(11, 2), _ids(12, 3), _ids(9, 4)
    tables = {"a": [5, 1], "b": [0, 7], "c": [3, 6, 2]}
    caches = model.allocate_kv_caches(num_blocks=8, block_size=BLOCK, dtype=model.dtype)
    first = _run(model, caches, a[:10] + b[:4],
                 [(tables["a"], 0, 10), (tables["b"], 0, 4)], step_builder)
    second = _run(model, caches, a[10:] + b[4:] + c,
                  [(tables["a"], 10, 1), (tables["b"], 4, 8), (tables["c"], 0, 9)],
                  step_builder)
    ra, rb, rc = hf_logits(tiny, a), hf_logits(tiny, b), hf_logits(tiny, c)
    torch.testing.assert_close(first, torch.cat([ra[:10], rb[:4]]), atol=ATOL, rtol=0)
    torch.testing.assert_close(second, torch.cat([ra[10:], rb[4:], rc]), atol=ATOL, rtol=0)


def test_decode_batch(tiny, step_builder, hf_logits) -> None:
    """A decode-only step of three sequences at different lengths."""
    model, _ = load_model(tiny)
    seqs = [_ids(n, 10 + n) for n in (5, 17, 9)]
    tables = [[4], [0, 8, 2], [6, 1]]
    caches = model.allocate_kv_caches(num_blocks=9, block_size=BLOCK, dtype=model.dtype)
    _run(model, caches, [t for s in seqs for t in s[:-1]],
         [(tb, 0, len(s) - 1) for tb, s in zip(tables, seqs, strict=True)], step_builder)
    last = _run(model, caches, [s[-1] for s in seqs],
                [(tb, len(s) - 1, 1) for tb, s in zip(tables, seqs, strict=True)], step_builder)
    ref = torch.stack([hf_logits(tiny, s)[-1] for s in seqs])
    torch.testing.assert_close(last, ref, atol=ATOL, rtol=0)
