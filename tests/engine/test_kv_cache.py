"""Block pool and KV cache manager: ref counts, LRU eviction, hash chains, prefix hits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localpaged.engine.kv_cache import MAX_KEPT_PER_PARENT, BlockPool, KVCacheManager, hash_block
from localpaged.engine.request import Request, SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def check_pool(pool: BlockPool, tables: dict[str, list]) -> None:
    """No block both free and in use; ref counts equal table memberships; hashes consistent."""
    refs: dict[int, int] = {}
    for blocks in tables.values():
        for b in blocks:
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
    for b in pool.blocks:
        assert b.ref_cnt >= 0
        assert b.ref_cnt == refs.get(b.block_id, 0)
        assert (b.ref_cnt == 0) == (b.block_id in pool.free_queue)
    for h, b in pool.cached.items():
        assert b.block_hash == h
    kept = [b for blocks in pool.partial.values() for b in blocks.values()]
    assert len(kept) == len({b.block_id for b in kept})
    for b in pool.blocks:
        assert (b.partial is not None) == (b in kept)
    for parent, blocks in pool.partial.items():
        assert blocks  # no empty entries
        for b in blocks.values():  # kept only while free, never beside a full block's hash
            assert b.partial is not None and b.partial[0] == parent
            assert b.ref_cnt == 0 and b.block_hash is None and b.partial[1]


def test_hash_chain_depends_on_parent_and_tokens() -> None:
    a = hash_block(None, [1, 2, 3])
    assert a == hash_block(None, [1, 2, 3])
    assert a != hash_block(None, [1, 2, 4])
    assert hash_block(a, [5]) != hash_block(hash_block(None, [9, 9, 9]), [5])


def test_prefix_hit_reuses_blocks_and_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert kv.get_computed_blocks(a) == ([], 0)
    assert kv.allocate_slots(a, 10)
    first_two = kv.block_ids("a")[:2]
    kv.free(a)
    b = req("b", list(range(8)))  # exactly 2 blocks: only 1 may be a hit (1 token must compute)
    hits, n = kv.get_computed_blocks(b)
    assert n == 4 and [h.block_id for h in hits] == first_two[:1]
    c = req("c", [*range(8), 100, 101])
    hits, n = kv.get_computed_blocks(c)
    assert n == 8 and [h.block_id for h in hits] == first_two
    assert kv.allocate_slots(c, 2, hits)
    assert kv.block_ids("c")[:2] == first_two
    check_pool(kv.pool, kv.req_blocks)


def test_a_follow_up_takes_over_the_part_filled_block_its_history_left() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", list(range(10)))  # 2 full blocks, then 2 tokens in a third
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    a_blocks = kv.block_ids("a")
    kv.free(a)
    check_pool(kv.pool, kv.req_blocks)
    # The follow-up continues a's 10 tokens: 2 full blocks and 2 tokens of the third cached.
    b = req("b", [*range(10), 50, 51, 52])
    assert kv.cached_prefix_tokens(b) == 10
    hits, n = kv.get_computed_blocks(b)
    assert n == 10 and [h.block_id for h in hits] == a_blocks
    assert kv.allocate_slots(b, 3, hits, n)
    assert kv.block_ids("b") == [*a_blocks, kv.block_ids("b")[3]]
    check_pool(kv.pool, kv.req_blocks)
    # b holds the block and writes into it: nobody else may take it meanwhile.
    c = req("c", [*range(10), 60])
    hits, n = kv.get_computed_blocks(c)
    assert n == 8 and [h.block_id for h in hits] == a_blocks[:2]
    kv.free(b)  # b computed nothing: its blocks are freed, nothing is kept
    assert not kv.pool.partial


def test_a_prompt_that_parts_from_the_kept_tokens_takes_the_matching_ones() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = req("a", [1, 2, 3, 4, 5, 6, 7])
    assert kv.allocate_slots(a, 7)
    a.num_computed_tokens = 7  # kept: [5, 6, 7] after the first block
    kv.free(a)
    b = req("b", [1, 2, 3, 4, 5, 6, 9, 9])
    hits, n = kv.get_computed_blocks(b)
    assert n == 6 and len(hits) == 2
    # Never the prompt's last token (its logits are needed), and never a salted prompt's.
    assert kv.cached_prefix_tokens(req("c", [1, 2, 3, 4, 5])) == 4
    salted = Request("d", [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(), rope_offset=3)
    assert kv.cached_prefix_tokens(salted) == 0
    # Taken for anything else, the block is forgotten.
    kv.pool.take_new_blocks(kv.num_free_blocks)
    assert not kv.pool.partial
    assert kv.cached_prefix_tokens(b) == 0


def test_few_part_filled_blocks_are_kept_under_one_parent() -> None:
    """Short prompts all end under the root: the oldest kept ones are let go, so a lookup
    never scans many (they stay free blocks, only no longer findable)."""
    kv = KVCacheManager(num_blocks=MAX_KEPT_PER_PARENT + 4, block_size=4)
    for i in range(MAX_KEPT_PER_PARENT + 2):
        r = req(f"r{i}", [100 + i, 1])
        assert kv.allocate_slots(r, 2)
        r.num_computed_tokens = 2
        kv.free(r)
    (kept,) = kv.pool.partial.values()
    assert len(kept) == MAX_KEPT_PER_PARENT
    check_pool(kv.pool, kv.req_blocks)
    assert kv.cached_prefix_tokens(req("old", [100, 1, 7])) == 0
    newest = MAX_KEPT_PER_PARENT + 1
    assert kv.cached_prefix_tokens(req("new", [100 + newest, 1, 7])) == 2


def test_lru_evicts_least_recently_freed_and_tail_blocks_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3, 4])
    assert kv.allocate_slots(a, 4)
    b = req("b", [5, 6, 7, 8])
    assert kv.allocate_slots(b, 4)
    kv.free(a)  # a's tail block freed first, then its head
    kv.free(b)
    # Taking one block evicts a's tail; a's head block (the shared prefix) is still cached.
    kv.pool.take_new_blocks(1)
    _hits, n = kv.get_computed_blocks(req("a2", [1, 2, 3, 4, 9]))
    assert n == 2
    tail_hash = hash_block(hash_block(None, [1, 2]), [3, 4])
    assert kv.pool.get_cached_block(tail_hash) is None


def test_allocation_failure_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = req("a", list(range(12)))
    before = kv.num_free_blocks
    assert not kv.allocate_slots(a, 12)
    assert kv.num_free_blocks == before and "a" not in kv.req_blocks


def test_duplicate_content_does_not_steal_the_cached_block() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    a, b = req("a", [1, 2, 3]), req("b", [1, 2, 3])
    assert kv.allocate_slots(a, 3)
    assert kv.allocate_slots(b, 3)  # computed concurrently: same content, separate blocks
    h = hash_block(None, [1, 2])
    assert kv.pool.cached[h].block_id == kv.block_ids("a")[0]
    kv.free(a)
    kv.free(b)
    check_pool(kv.pool, kv.req_blocks)


def test_freeing_twice_is_an_error() -> None:
    pool = BlockPool(2)
    (blk,) = pool.take_new_blocks(1)
    pool.free([blk])
    with pytest.raises(RuntimeError):
        pool.free([blk])


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_pool_invariants_under_random_operations(data: st.DataObject) -> None:
    bs = data.draw(st.sampled_from([1, 2, 4]))
    kv = KVCacheManager(num_blocks=data.draw(st.integers(1, 12)), block_size=bs)
    live: dict[str, Request] = {}
    for step in range(data.draw(st.integers(1, 30))):
        if live and data.draw(st.booleans()):
            rid = data.draw(st.sampled_from(sorted(live)))
            kv.free(live.pop(rid))
        else:
            # Small alphabet: prompts share prefixes often.
            tokens = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=12))
            r = req(f"r{step}", tokens)
            hits, n = kv.get_computed_blocks(r)
            assert n < r.num_tokens
            assert len(hits) == -(-n // bs)
            if kv.allocate_slots(r, r.num_tokens - n, hits, n):
                r.num_computed_tokens = r.num_tokens
                live[r.request_id] = r
                assert len(kv.req_blocks[r.request_id]) == -(-r.num_tokens // bs)
        check_pool(kv.pool, kv.req_blocks)
