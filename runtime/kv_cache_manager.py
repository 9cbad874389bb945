"""Paged KV cache bookkeeping: a block pool with reference counts and automatic prefix caching.

Plain Python, no torch (STYLE #7): the model runner owns the KV tensors, this module only decides
which block ids hold which tokens. Block 0 is reserved and never handed out, so the runner can
point padding tokens at it without corrupting anyone's cache.

Prefix caching keys each FULL block by (parent key id, the block's token ids, extra keys), a hash
chain in which the parent is named by a unique id given to the parent block when it was cached,
rather than by the parent's hash value. Python's dict then compares whole keys on every hit, so a
hash collision can never map a block that holds other tokens, and cache ids are never reused, so a
block whose parent was evicted and refilled becomes unreachable instead of wrong. The first
block's extra keys carry the request's cache salt; every later block inherits it through the
chain, which is what isolates tenants.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from compile_engine.runtime.request import Request

# Parent id of a chain's first block. Real cache ids start at 1.
_ROOT = 0

# (parent cache id, the block's token ids, extra keys: the cache salt for a chain's first block)
PrefixKey = tuple[int, tuple[int, ...], object]


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    # Set while the block is findable by prefix lookup (it may be free or referenced).
    key: PrefixKey | None = None
    cache_id: int = 0
    # Intrusive links of the free list; both None while the block is referenced.
    prev_free: Block | None = field(default=None, repr=False)
    next_free: Block | None = field(default=None, repr=False)


class BlockPool:
    """Blocks 1..num_blocks-1 with reference counts, an LRU free list and the prefix cache.

    The free list is intrusive and doubly linked so that a prefix hit on a free block takes it out
    of the middle in O(1). Its head is evicted first. Free blocks that still hold cached content
    stay findable through `cached` until they are evicted to be reused.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need at least 2 (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.cached: dict[PrefixKey, Block] = {}
        self._next_cache_id = _ROOT + 1
        # Sentinel of the circular free list: head is _free.next_free, tail is _free.prev_free.
        self._free = Block(-1)
        self._free.prev_free = self._free.next_free = self._free
        self.num_free = 0
        for block in self.blocks[1:]:
            self._push_tail(block)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    # -- free list ---------------------------------------------------------------------------

    def _push_tail(self, block: Block) -> None:
        last = self._free.prev_free
        block.prev_free, block.next_free = last, self._free
        last.next_free = self._free.prev_free = block
        self.num_free += 1

    def _push_head(self, block: Block) -> None:
        first = self._free.next_free
        block.prev_free, block.next_free = self._free, first
        first.prev_free = self._free.next_free = block
        self.num_free += 1

    def _unlink(self, block: Block) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def free_order(self) -> list[int]:
        """Free block ids, next to be evicted first (for tests and debugging)."""
        ids, block = [], self._free.next_free
        while block is not self._free:
            ids.append(block.block_id)
            block = block.next_free
        return ids

    # -- allocation ---------------------------------------------------------------------------

    def take_new(self, n: int) -> list[Block]:
        """Pop n blocks from the LRU end, evicting whatever they cached. Caller checks num_free."""
        assert n <= self.num_free, f"asked for {n} blocks with only {self.num_free} free"
        out = []
        for _ in range(n):
            block = self._free.next_free
            self._unlink(block)
            if block.key is not None:
                self.uncache(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, block: Block) -> None:
        """Take one more reference, pulling the block off the free list if it was there."""
        if block.ref_cnt == 0:
            self._unlink(block)
        block.ref_cnt += 1

    def release(self, blocks: Sequence[Block]) -> None:
        """Drop one reference to each block; pass them in the order they should be evicted.

        A block that reaches zero goes to the tail (most recently used) if it holds cached content
        and to the head otherwise: an uncached block is worth nothing, so it is reused first.
        """
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} released more than taken"
            if block.ref_cnt == 0:
                if block.key is None:
                    self._push_head(block)
                else:
                    self._push_tail(block)

    # -- prefix cache -------------------------------------------------------------------------

    def cache(self, block: Block, key: PrefixKey) -> Block:
        """Make `block` findable under `key`; if another block already is, keep that one.

        Returns the block whose cache id the chain continues under. A block already cached under
        another chain id (a sibling re-walking a shared block) keeps it: same tokens, same
        position, same prefix, so either id names the same content.
        """
        if block.key is not None:
            return block
        existing = self.cached.get(key)
        if existing is not None:
            return existing
        block.key = key
        block.cache_id = self._next_cache_id
        self._next_cache_id += 1
        self.cached[key] = block
        return block

    def uncache(self, block: Block) -> None:
        del self.cached[block.key]
        block.key = None
        block.cache_id = 0

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (e.g. after a weight update). Returns how many were cached.

        Referenced blocks keep their KV; they simply stop being findable. Requests that keep
        growing chain their new blocks under ids that no lookup can reach again, which is safe.
        """
        n = len(self.cached)
        for block in list(self.cached.values()):
            self.uncache(block)
        return n


@dataclass(slots=True, eq=False)
class _RequestBlocks:
    request: Request
    blocks: list[Block] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    # Blocks [0, num_cached) have been offered to the prefix cache; the next one chains under
    # parent_id (the cache id of the block that is cached for the content of block num_cached-1).
    num_cached: int = 0
    parent_id: int = _ROOT


class KVCacheManager:
    """Per-request block tables over one BlockPool, with automatic prefix caching.

    Call pattern, per request: `get_computed_blocks` on admission (prefix hits), then
    `allocate_slots` before every step it is scheduled in, `cache_blocks` after every step, and
    `free` when it finishes or is preempted. `fork_prefix` lets sibling requests (n > 1) share the
    blocks of a leader that has already computed the common prompt.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be >= 1")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, _RequestBlocks] = {}
        # In tokens, as vLLM's prefix_cache_queries / prefix_cache_hits (`count_lookup`).
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- queries ------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of usable blocks that some request references (cached free ones don't count)."""
        return 1.0 - self.pool.num_free / self.pool.num_usable

    def get_block_ids(self, request_id: str) -> list[int]:
        table = self._tables.get(request_id)
        return list(table.block_ids) if table is not None else []

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self._tables

    def _key(self, parent_id: int, tokens: list[int], index: int, request: Request) -> PrefixKey:
        bs = self.block_size
        salt = request.cache_salt if index == 0 else None
        return (parent_id, tuple(tokens[index * bs : (index + 1) * bs]), salt)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of the request's full blocks: (block ids, tokens covered).

        At least the last known token is always left to compute so that the model produces the
        logits to sample from. Takes no references: pass the ids to `allocate_slots` in the same
        scheduling pass.
        """
        if not self.enable_prefix_caching:
            return [], 0
        tokens = request.all_token_ids
        ids: list[int] = []
        parent_id = _ROOT
        for i in range((len(tokens) - 1) // self.block_size):
            block = self.pool.cached.get(self._key(parent_id, tokens, i, request))
            if block is None:
                break
            ids.append(block.block_id)
            parent_id = block.cache_id
        return ids, len(ids) * self.block_size

    # -- allocation ---------------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()
    ) -> bool:
        """Make the block table cover request.num_computed_tokens + hits + num_new_tokens slots.

        `new_computed_blocks` are prefix hits from `get_computed_blocks` for a request that has
        no blocks yet. Returns False, changing nothing, when the pool cannot supply the blocks;
        free blocks that hold cached content count as available (the LRU ones are evicted).
        """
        table = self._tables.get(request.request_id)
        admitting = table is None
        num_existing = 0 if admitting else len(table.blocks)
        assert admitting or not new_computed_blocks, "prefix hits are only taken on admission"
        hits = [self.pool.blocks[i] for i in new_computed_blocks]
        num_slots = request.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        num_needed = -(-num_slots // self.block_size) - num_existing - len(hits)
        # Hit blocks that sit on the free list leave it when we take them.
        num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_needed > self.pool.num_free - num_free_hits:
            return False
        if admitting:
            table = self._tables[request.request_id] = _RequestBlocks(request)
        # Touch hits before taking new blocks, or eviction could hand a hit back out.
        for block in hits:
            self.pool.touch(block)
            table.blocks.append(block)
            table.block_ids.append(block.block_id)
        if hits:
            table.num_cached = len(hits)
            table.parent_id = hits[-1].cache_id
        if num_needed > 0:
            for block in self.pool.take_new(num_needed):
                table.blocks.append(block)
                table.block_ids.append(block.block_id)
        return True

    def count_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count an admitted request's prefix lookup in tokens, as vLLM's counters do: queried
        = its tokens, hit = those its cached (or forked) blocks cover. vLLM counts a lookup of
        a new request only: none with caching off, none for a prompt that must be scored
        (it reads no hit), and a preempted request's re-lookup apart, unexported, so that a
        victim finding its own blocks again does not raise the hit rate. vLLM counts each
        scheduling attempt; the scheduler calls this once the admission succeeded, which is the
        same whenever the first attempt fits."""
        if not self.enable_prefix_caching or request.num_preemptions:
            return
        self.prefix_queries += request.num_tokens
        self.prefix_hits += num_hit_tokens

    def fork_prefix(self, parent: Request, child: Request) -> int:
        """Share the parent's full prompt blocks with a sibling that has no blocks yet.

        The parent must have computed its whole prompt. At least the child's last prompt token is
        left to compute, so it never writes into a shared block. Sets and returns the child's
        num_computed_tokens; the caller then calls `allocate_slots` for the rest (and, if that
        fails, `free` on the child and resets its num_computed_tokens to 0).
        """
        assert child.request_id not in self._tables, f"{child.request_id} already has blocks"
        source = self._tables[parent.request_id]
        assert parent.num_computed_tokens >= parent.num_prompt_tokens, "parent prompt not done"
        assert child.prompt_token_ids == parent.prompt_token_ids, "siblings must share a prompt"
        n = min((child.num_prompt_tokens - 1) // self.block_size, len(source.blocks))
        table = self._tables[child.request_id] = _RequestBlocks(child)
        for block in source.blocks[:n]:
            self.pool.touch(block)
            table.blocks.append(block)
            table.block_ids.append(block.block_id)
        # num_cached stays 0: cache_blocks re-walks the shared blocks to find the chain's ids,
        # which also works when the parent's blocks were never cached (caching disabled).
        child.num_computed_tokens = n * self.block_size
        return child.num_computed_tokens

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Offer the blocks that are now full of computed tokens to the prefix cache.

        If identical content is already cached in another block (two requests computed the same
        prefix at once), that block stays canonical and this one stays uncached; the chain goes on
        under the canonical block's id so that later blocks are still findable.
        """
        if not self.enable_prefix_caching:
            return
        table = self._tables[request.request_id]
        num_full = min(num_computed_tokens, request.num_tokens) // self.block_size
        if num_full <= table.num_cached:
            return
        tokens = request.all_token_ids
        parent_id = table.parent_id
        for i in range(table.num_cached, num_full):
            key = self._key(parent_id, tokens, i, request)
            parent_id = self.pool.cache(table.blocks[i], key).cache_id
        table.num_cached = num_full
        table.parent_id = parent_id

    def trim(self, request: Request) -> None:
        """Release the blocks past those that hold `request.num_computed_tokens` (rejected
        draft tokens). They hold no full block of known tokens, so none of them is cached."""
        table = self._tables[request.request_id]
        keep = -(-request.num_computed_tokens // self.block_size)
        if len(table.blocks) > keep:
            extra = table.blocks[keep:]
            del table.blocks[keep:], table.block_ids[keep:]
            self.pool.release(extra[::-1])

    def free(self, request: Request) -> None:
        """Release the request's blocks (finish, abort or preemption). Safe to call twice."""
        table = self._tables.pop(request.request_id, None)
        if table is not None:
            # Reverse order: a chain's tail is evicted before the parents other prompts share.
            self.pool.release(table.blocks[::-1])

    def reset_prefix_cache(self) -> int:
        """Forget all cached content (e.g. after a weight update); returns how many blocks were
        cached. Live requests keep their blocks; the blocks they fill later chain under ids that no
        lookup reaches any more, so they are simply never hit."""
        return self.pool.reset_prefix_cache()

    # -- invariants ---------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant. Cheap enough for tests and an
        idle loop, O(blocks + table entries)."""
        pool, bs = self.pool, self.block_size
        reserved = pool.blocks[0]
        assert reserved.ref_cnt == 0 and reserved.key is None, "block 0 was handed out or cached"
        assert reserved.prev_free is None, "block 0 is on the free list"

        free_ids: set[int] = set()
        prev, block = pool._free, pool._free.next_free
        while block is not pool._free:
            assert block.prev_free is prev, f"free list back link broken at block {block.block_id}"
            assert block.block_id not in free_ids, f"block {block.block_id} is free twice"
            assert block.ref_cnt == 0, (
                f"block {block.block_id} is free with ref_cnt {block.ref_cnt}"
            )
            assert block.block_id != 0, "block 0 is on the free list"
            free_ids.add(block.block_id)
            prev, block = block, block.next_free
            assert len(free_ids) <= pool.num_usable, "free list has a cycle"
        assert pool._free.prev_free is prev, "free list tail link broken"
        assert len(free_ids) == pool.num_free, (
            f"free list holds {len(free_ids)} blocks but num_free says {pool.num_free}"
        )

        refs = [0] * pool.num_blocks
        for rid, table in self._tables.items():
            assert table.request.request_id == rid, f"table of {rid} holds another request"
            assert table.block_ids == [b.block_id for b in table.blocks], f"{rid}: ids out of sync"
            assert len(set(table.block_ids)) == len(table.block_ids), f"{rid}: block listed twice"
            assert 0 not in table.block_ids, f"{rid} holds reserved block 0"
            tokens = table.request.all_token_ids
            for i, b in enumerate(table.blocks):
                refs[b.block_id] += 1
                if b.key is not None:
                    content = tuple(tokens[i * bs : (i + 1) * bs])
                    assert b.key[1] == content, (
                        f"{rid}: block {b.block_id} at index {i} is cached for {b.key[1]} "
                        f"but the request holds {content} there"
                    )
                    if i == 0:
                        assert b.key[2] == table.request.cache_salt, (
                            f"{rid}: block {b.block_id} is cached under another cache salt"
                        )
        for b in pool.blocks[1:]:
            assert b.ref_cnt == refs[b.block_id], (
                f"block {b.block_id} has ref_cnt {b.ref_cnt} but {refs[b.block_id]} table entries"
            )
            assert (b.ref_cnt == 0) == (b.block_id in free_ids), (
                f"block {b.block_id}: ref_cnt {b.ref_cnt} disagrees with free-list membership"
            )

        for key, b in pool.cached.items():
            assert b.key is key or b.key == key, f"cached key of block {b.block_id} disagrees"
            assert len(key[1]) == bs, f"block {b.block_id} is cached while not full"
            assert 0 < key[0] < b.cache_id or key[0] == _ROOT, (
                f"block {b.block_id} chains under id {key[0]} that was not issued before it"
            )
        num_keyed = sum(1 for b in pool.blocks if b.key is not None)
        assert num_keyed == len(pool.cached), "a block holds a key the cache does not map to it"
