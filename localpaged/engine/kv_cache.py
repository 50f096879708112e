"""KV cache bookkeeping: the block pool and the per-request cache manager. No torch here.

The tensors live in the runner; this module only decides which block ids hold which tokens.
A *full* block gets a content hash chained to its parent's: `hash(parent, tokens, extra)`.
A freed block keeps its hash and stays findable in the prefix cache until it is reused for
something else (LRU: the block freed longest ago is taken first), so a new request whose
leading blocks hash the same takes them without recomputing.

A request's last, part-filled block is kept too when it ends, under the hash of the blocks
before it with the tokens it holds: the next turn of a chat continues that history, so it
takes the block over (it is nobody else's) and writes its own tokens after the matching ones,
instead of computing up to a block's worth of its history again.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from localpaged.engine.request import Request

BlockHash = bytes
MAX_KEPT_PER_PARENT = 8  # part-filled blocks kept under one parent hash (see keep_partial)


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Content hash of one full block, chained to its parent block's hash.

    A cryptographic hash, so that crafted prompts cannot collide with another chat's blocks."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()


def root_key(salt: bytes) -> BlockHash:
    """What a request's first block is kept under when part-filled (no parent hash)."""
    return b"root" + salt


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # A part-filled block kept after its request ended: (the hash of the blocks before it,
    # the tokens whose K/V it holds).
    partial: tuple[BlockHash, tuple[int, ...]] | None = None


class BlockPool:
    """Fixed set of blocks: ref counts, a free queue in LRU order, and the hash -> block map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} is invalid: expected >= 1")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        # Free blocks, least recently freed first. Values unused; OrderedDict gives O(1) removal.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockHash, KVBlock] = {}
        self.partial: dict[BlockHash, dict[int, KVBlock]] = {}  # parent hash -> kept blocks
        self.num_evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def take_new_blocks(self, n: int) -> list[KVBlock]:
        """Pop n free blocks (evicting their cached content) with ref count 1."""
        if n > len(self.free_queue):
            raise ValueError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            self._forget_partial(block)
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on prefix-cache hits (reviving them from the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            self._forget_partial(block)  # its new holder writes after the kept tokens
            block.ref_cnt += 1

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop a reference on each block; blocks reaching 0 join the free queue's tail.

        Callers pass a request's blocks tail first, so a chain's last blocks are evicted
        before its first ones (the first ones are the most shared)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed with ref count {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = None

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a full block's content hash. A duplicate of an already cached block stays
        unregistered (it is freed normally); the first copy keeps serving hits."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def keep_partial(self, block: KVBlock, parent: BlockHash, tokens: tuple[int, ...]) -> None:
        """Keep a free, part-filled block findable under its parent's hash (`find_partial`)
        until it is taken for anything."""
        if not self.enable_caching or block.ref_cnt or not tokens:
            return
        self._forget_partial(block)
        kept = self.partial.setdefault(parent, {})
        if len(kept) >= MAX_KEPT_PER_PARENT:  # many short prompts end under one parent:
            self._forget_partial(next(iter(kept.values())))  # lookups stay short (oldest out)
        block.partial = (parent, tokens)
        kept[block.block_id] = block

    def find_partial(self, parent: BlockHash, tokens: Sequence[int]) -> tuple[KVBlock, int] | None:
        """The kept block under `parent` whose tokens begin `tokens` the longest way, and how
        many of them match (at least one); None when none matches."""
        best: tuple[KVBlock, int] | None = None
        for block in self.partial.get(parent, {}).values():
            assert block.partial is not None
            kept = block.partial[1]
            n = 0
            for a, b in zip(kept, tokens):
                if a != b:
                    break
                n += 1
            if n and (best is None or n > best[1]):
                best = (block, n)
        return best

    def _forget_partial(self, block: KVBlock) -> None:
        if block.partial is None:
            return
        kept = self.partial[block.partial[0]]
        del kept[block.block_id]
        if not kept:
            del self.partial[block.partial[0]]
        block.partial = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after loading another model)."""
        for block in self.blocks:
            block.block_hash = None
            block.partial = None
        self.cached.clear()
        self.partial.clear()


@dataclass
class CacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found cached


class KVCacheManager:
    """Per-request block tables on top of a BlockPool, with prefix-cache lookups."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size} is invalid: expected >= 1")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_hashed_blocks: dict[str, int] = {}  # leading blocks already registered
        self.stats = CacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def _update_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend request.block_hashes to cover every full block of its first num_tokens."""
        bs = self.block_size
        tokens = request.all_token_ids
        while (len(request.block_hashes) + 1) * bs <= num_tokens:
            i = len(request.block_hashes)
            parent = request.block_hashes[-1] if i else None
            request.block_hashes.append(hash_block(parent, tokens[i * bs:(i + 1) * bs],
                                                   request.cache_salt))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Blocks of the request's prompt already in the prefix cache, following the blocks it
        holds, and their token count: a new request's cached prefix (its full blocks, then a
        part-filled block an ended request left, when its tokens continue the prompt), or, for
        one part-way through its prompt (at a block boundary), the full blocks another request
        computed meanwhile (several chats sharing a long prefix then compute it once,
        together).

        At least one token is always left to compute: its logits give the next token."""
        own = len(self.req_blocks.get(request.request_id, ()))
        if not self.enable_prefix_caching or request.num_computed_tokens != own * self.block_size:
            return [], 0
        hits, num_hit = self._cached_prefix(request, own)
        if own == 0:
            self.stats.queries += request.num_tokens
        self.stats.hits += num_hit
        return hits, num_hit

    def cached_prefix_tokens(self, request: Request) -> int:
        """Tokens of a new request's prompt the prefix cache holds now (what
        `get_computed_blocks` would give), without counting the lookup in the stats."""
        if not self.enable_prefix_caching or request.num_computed_tokens:
            return 0
        return self._cached_prefix(request, 0)[1]

    def _cached_prefix(self, request: Request, own: int) -> tuple[list[KVBlock], int]:
        """The cached blocks that continue the request's prompt after its first `own` blocks,
        and their tokens (never its last token: that token's logits are needed). A kept
        part-filled block only for a new request (`own` 0)."""
        bs = self.block_size
        self._update_hashes(request, request.num_tokens)
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[own:(request.num_tokens - 1) // bs]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit = len(hits) * bs
        if own == 0:
            found = self.pool.find_partial(self._parent_key(request, len(hits)),
                                           request.all_token_ids[num_hit:request.num_tokens - 1])
            if found is not None:
                hits.append(found[0])
                num_hit += found[1]
        return hits, num_hit

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVBlock] = (),
        num_new_computed_tokens: int | None = None,
    ) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens (after its computed ones and
        the prefix hits in `new_computed_blocks`, holding `num_new_computed_tokens`: as
        `get_computed_blocks` gave them; full blocks by default). Returns False, changing
        nothing, if the pool cannot supply them."""
        if num_new_computed_tokens is None:
            num_new_computed_tokens = len(new_computed_blocks) * self.block_size
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        total = num_computed + num_new_tokens
        need = -(-total // self.block_size) - len(blocks) - len(new_computed_blocks)
        # Hits sitting in the free queue stop being free once touched.
        reviving = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - reviving:
            if not blocks:
                del self.req_blocks[request.request_id]
            return False
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        if need > 0:
            blocks.extend(self.pool.take_new_blocks(need))
        if self.enable_prefix_caching:
            # Tokens up to `total` are known now (prompt, or the sampled token being fed back),
            # and their K/V is written this step: their full blocks can serve later requests.
            self._update_hashes(request, total)
            done = self.num_hashed_blocks.get(request.request_id, 0)
            for i in range(done, total // self.block_size):
                self.pool.cache_block(blocks[i], request.block_hashes[i])
            self.num_hashed_blocks[request.request_id] = max(done, total // self.block_size)
        return True

    def free(self, request: Request) -> None:
        """Release all of a request's blocks (tail first), keeping its part-filled last block
        findable for a prompt that continues its tokens."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_hashed_blocks.pop(request.request_id, None)
        self.pool.free(list(reversed(blocks)))
        full, rest = divmod(request.num_computed_tokens, self.block_size)
        if self.enable_prefix_caching and rest and full < len(blocks):
            self._update_hashes(request, request.num_computed_tokens)
            start = full * self.block_size
            self.pool.keep_partial(blocks[full], self._parent_key(request, full), tuple(
                request.all_token_ids[start:request.num_computed_tokens]))

    @staticmethod
    def _parent_key(request: Request, full: int) -> BlockHash:
        """What a part-filled block after the request's first `full` blocks is kept under:
        the last of their hashes, or the root key of the request's salt."""
        return request.block_hashes[full - 1] if full else root_key(request.cache_salt)
