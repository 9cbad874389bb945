"""KV cache manager: focused cases, then a hypothesis state machine with a shadow of block contents.

The shadow records, for every block slot, which (cache salt, token prefix) last wrote it, as the
GPU would hold it. Any request may then only read slots holding exactly its own salt and prefix:
that is the property prefix caching, forking and eviction must never break.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from compile_engine.runtime.kv_cache_manager import KVCacheManager
from compile_engine.runtime.request import Request
from compile_engine.runtime.sampling_params import SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[2]

_ids = iter(range(10**9))


def make_request(prompt: list[int], salt: str | None = None, rid: str | None = None) -> Request:
    rid = rid if rid is not None else f"r{next(_ids)}"
    return Request(rid, prompt, SamplingParams(max_tokens=None), cache_salt=salt)


def run_prefill(kv: KVCacheManager, request: Request) -> None:
    """Admit with prefix lookup and compute the whole prompt in one step."""
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hits)
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request, request.num_computed_tokens)


def test_imports_no_torch() -> None:
    code = "import runtime.kv_cache_manager, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


def test_block_zero_is_never_handed_out() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4, enable_prefix_caching=False)
    r = make_request(list(range(16)))
    assert kv.allocate_slots(r, 16)
    assert sorted(kv.get_block_ids(r.request_id)) == [1, 2, 3, 4]
    assert kv.usage == 1.0
    assert not kv.allocate_slots(make_request([1]), 1)
    kv.check_integrity()


def test_failed_allocation_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = make_request(list(range(8)))
    run_prefill(kv, a)
    free_before = kv.pool.free_order()
    b = make_request(list(range(100, 112)))
    assert not kv.allocate_slots(b, 12)
    assert kv.pool.free_order() == free_before and not kv.has_blocks(b.request_id)
    kv.check_integrity()


def test_at_least_one_token_left_to_compute() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    # An exact multiple of the block size: the last full block cannot be a hit.
    run_prefill(kv, make_request(list(range(8))))
    assert kv.get_computed_blocks(make_request(list(range(8))))[1] == 4
    # One token more: both full blocks hit, the ninth token is computed.
    assert kv.get_computed_blocks(make_request(list(range(9))))[1] == 8
    # A one-token prompt never hits.
    assert kv.get_computed_blocks(make_request([0]))[1] == 0


def test_hit_takes_a_cached_free_block_out_of_the_middle_of_the_free_list() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request(list(range(9)))
    run_prefill(kv, a)
    a_ids = kv.get_block_ids(a.request_id)
    kv.free(a)
    b = make_request(list(range(9)))
    hits, num_hit = kv.get_computed_blocks(b)
    assert hits == a_ids[:2] and num_hit == 8
    assert kv.allocate_slots(b, 1, hits)
    assert not set(hits) & set(kv.pool.free_order())
    kv.check_integrity()


def test_eviction_prefers_chain_ends() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)  # 3 usable blocks
    a = make_request(list(range(12)))
    run_prefill(kv, a)
    first, second, third = kv.get_block_ids(a.request_id)
    kv.free(a)
    # Freed in reverse: the chain's tail is first in line for eviction, its root last.
    assert kv.pool.free_order() == [third, second, first]
    other = make_request([99] * 3)
    assert kv.allocate_slots(other, 3)
    assert kv.get_block_ids(other.request_id) == [third]
    # The shared parents survived: a request with a's prompt still hits both.
    again = make_request(list(range(12)))
    assert kv.get_computed_blocks(again) == ([first, second], 8)


def test_uncached_free_blocks_are_reused_before_cached_ones() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request(list(range(6)))  # one full cached block and one partial block
    run_prefill(kv, a)
    full, partial = kv.get_block_ids(a.request_id)
    kv.free(a)
    assert kv.pool.free_order()[0] == partial
    assert kv.pool.free_order()[-1] == full


def test_cache_salt_isolates_tenants() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    run_prefill(kv, make_request(list(range(9)), salt="alice"))
    assert kv.get_computed_blocks(make_request(list(range(9)), salt="bob"))[1] == 0
    assert kv.get_computed_blocks(make_request(list(range(9))))[1] == 0
    assert kv.get_computed_blocks(make_request(list(range(9)), salt="alice"))[1] == 8


def test_same_tokens_under_another_parent_do_not_hit() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    run_prefill(kv, make_request([1, 1, 1, 1, 2, 2, 2, 2, 0]))
    assert kv.get_computed_blocks(make_request([3, 3, 3, 3, 2, 2, 2, 2, 0]))[1] == 0
    assert kv.get_computed_blocks(make_request([1, 1, 1, 1, 2, 2, 2, 3, 0]))[1] == 4


def test_duplicate_content_keeps_one_canonical_block_and_the_chain_goes_on() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(13))
    a, b = make_request(prompt), make_request(prompt)
    for r in (a, b):  # both computed before either was cached: no hits
        assert kv.allocate_slots(r, 8)
        r.num_computed_tokens = 8
    for r in (a, b):
        kv.cache_blocks(r, 8)
    for r in (b, a):  # b caches the third block: its chain went on under a's canonical blocks
        assert kv.allocate_slots(r, 5)
        r.num_computed_tokens = 13
        kv.cache_blocks(r, 13)
    kv.check_integrity()
    ids, num_hit = kv.get_computed_blocks(make_request(prompt + [7]))
    assert num_hit == 12
    assert ids == kv.get_block_ids(a.request_id)[:2] + kv.get_block_ids(b.request_id)[2:3]


def test_fork_prefix_shares_full_prompt_blocks() -> None:
    for caching in (True, False):
        kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=caching)
        parent = make_request(list(range(10)))
        run_prefill(kv, parent)
        child = make_request(list(range(10)))
        assert kv.fork_prefix(parent, child) == 8
        assert kv.allocate_slots(child, 2)
        p_ids, c_ids = kv.get_block_ids(parent.request_id), kv.get_block_ids(child.request_id)
        assert c_ids[:2] == p_ids[:2] and c_ids[2] != p_ids[2]
        assert [kv.pool.blocks[i].ref_cnt for i in p_ids] == [2, 2, 1]
        # An exact multiple of the block size still leaves the last prompt token to compute.
        parent8, child8 = make_request(list(range(8))), make_request(list(range(8)))
        run_prefill(kv, parent8)
        assert kv.fork_prefix(parent8, child8) == 4
        kv.check_integrity()


def test_check_integrity_reports_corruption() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = make_request(list(range(6)))
    run_prefill(kv, r)
    kv.pool.blocks[kv.get_block_ids(r.request_id)[0]].ref_cnt += 1
    with pytest.raises(AssertionError, match="ref_cnt"):
        kv.check_integrity()


def test_reset_prefix_cache_forgets_everything() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = make_request(list(range(9)))
    run_prefill(kv, r)
    assert kv.reset_prefix_cache() == 2
    assert kv.get_computed_blocks(make_request(list(range(9))))[1] == 0
    kv.check_integrity()


# -- state machine --------------------------------------------------------------------------

BLOCK_SIZE = 4
NUM_BLOCKS = 12  # 11 usable: 44 slots
MAX_LEN = 40
SALTS = (None, "tenant-b")
# A few shared openings (system prompts) plus a random tail over a two-token alphabet, so that
# prefixes, hits and near-misses are common.
PROMPTS = st.builds(
    lambda head, tail: head + tail,
    st.sampled_from([[], [1] * 8, [1, 2] * 5, [2, 1, 1, 2, 2, 1]]),
    st.lists(st.integers(1, 2), min_size=1, max_size=14),
)


class KVShadow:
    """What each block slot would hold on the device: (salt, token prefix) of its last writer."""

    def __init__(self) -> None:
        self.slots: dict[tuple[int, int], tuple[str | None, tuple[int, ...]]] = {}

    def write(self, kv: KVCacheManager, request: Request, start: int, end: int) -> None:
        ids = kv.get_block_ids(request.request_id)
        for pos in range(start, end):
            block = ids[pos // BLOCK_SIZE]
            assert kv.pool.blocks[block].ref_cnt == 1, f"writing shared block {block}"
            assert kv.pool.blocks[block].key is None, f"writing cached block {block}"
            prefix = tuple(request.all_token_ids[: pos + 1])
            self.slots[(block, pos % BLOCK_SIZE)] = (request.cache_salt, prefix)

    def check_reads(self, kv: KVCacheManager, request: Request, end: int) -> None:
        ids = kv.get_block_ids(request.request_id)
        for pos in range(end):
            held = self.slots.get((ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE))
            want = (request.cache_salt, tuple(request.all_token_ids[: pos + 1]))
            assert held == want, f"{request.request_id} position {pos} reads {held}, wants {want}"


class KVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True)
        self.live: dict[str, Request] = {}  # holding blocks
        self.parked: dict[str, Request] = {}  # preempted: no blocks, will be readmitted
        self.shadow = KVShadow()
        self.num_added = 0

    def _new_request(self, prompt: list[int], salt: str | None) -> Request:
        # Ids from the machine, not a global counter: replays must see the same sorted order.
        self.num_added += 1
        return make_request(prompt, salt, rid=f"r{self.num_added:04d}")

    def _admit(self, request: Request, chunk: int) -> None:
        hits, num_hit = self.kv.get_computed_blocks(request)
        assert num_hit < request.num_tokens and num_hit == len(hits) * BLOCK_SIZE
        num_new = min(chunk, request.num_tokens - num_hit)
        if not self.kv.allocate_slots(request, num_new, hits):
            assert not self.kv.has_blocks(request.request_id)
            self.parked[request.request_id] = request
            event("admission failed: pool full")
            return
        if num_hit:
            event("prefix hit")
        self.shadow.check_reads(self.kv, request, num_hit)
        request.num_computed_tokens = num_hit
        self.live[request.request_id] = request
        self._compute(request, num_new)

    def _compute(self, request: Request, num_new: int) -> None:
        start = request.num_computed_tokens
        self.shadow.write(self.kv, request, start, start + num_new)
        request.num_computed_tokens += num_new
        self.kv.cache_blocks(request, request.num_computed_tokens)

    @rule(
        prompt=PROMPTS,
        salt=st.sampled_from(SALTS),
        chunk=st.integers(1, 24),
    )
    def add(self, prompt: list[int], salt: str | None, chunk: int) -> None:
        self._admit(self._new_request(prompt, salt), chunk)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 12), token=st.integers(1, 2))
    def step(self, data: st.DataObject, chunk: int, token: int) -> None:
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if request.num_computed_tokens == request.num_tokens:
            if request.num_tokens >= MAX_LEN:
                return
            request.append_output_token(token)  # "sampled" at the end of the last step
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        if not self.kv.allocate_slots(request, num_new):
            self.kv.free(request)  # preempt by recompute
            request.num_computed_tokens = 0
            self.parked[request.request_id] = self.live.pop(request.request_id)
            event("preempted")
            return
        self._compute(request, num_new)

    @precondition(lambda self: self.parked)
    @rule(data=st.data(), chunk=st.integers(1, 24))
    def readmit(self, data: st.DataObject, chunk: int) -> None:
        request = self.parked.pop(data.draw(st.sampled_from(sorted(self.parked))))
        self._admit(request, chunk)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 24))
    def fork(self, data: st.DataObject, chunk: int) -> None:
        parent = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if parent.num_computed_tokens < parent.num_prompt_tokens:
            return
        child = self._new_request(parent.prompt_token_ids, parent.cache_salt)
        num_shared = self.kv.fork_prefix(parent, child)
        assert num_shared == child.num_computed_tokens < child.num_tokens
        event(f"fork shared {num_shared > 0}")
        self.shadow.check_reads(self.kv, child, num_shared)
        num_new = min(chunk, child.num_tokens - num_shared)
        if not self.kv.allocate_slots(child, num_new):
            self.kv.free(child)
            return
        self.live[child.request_id] = child
        self._compute(child, num_new)

    @precondition(lambda self: self.live or self.parked)
    @rule(data=st.data())
    def finish_or_abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live) + sorted(self.parked)))
        request = self.live.pop(rid, None) or self.parked.pop(rid)
        self.kv.free(request)
        self.kv.free(request)  # a second free is harmless

    @rule()
    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    @invariant()
    def integrity(self) -> None:
        self.kv.check_integrity()

    @invariant()
    def every_computed_token_reads_its_own_kv(self) -> None:
        for request in self.live.values():
            self.shadow.check_reads(self.kv, request, request.num_computed_tokens)

    @invariant()
    def cached_blocks_hold_the_requests_tokens(self) -> None:
        for request in self.live.values():
            for i, block_id in enumerate(self.kv.get_block_ids(request.request_id)):
                key = self.kv.pool.blocks[block_id].key
                if key is not None:
                    want = request.all_token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
                    assert list(key[1]) == want

    @invariant()
    def different_salts_share_no_blocks(self) -> None:
        owners: dict[int, str | None] = {}
        for request in self.live.values():
            for block_id in self.kv.get_block_ids(request.request_id):
                salt = owners.setdefault(block_id, request.cache_salt)
                assert salt == request.cache_salt, f"block {block_id} shared across salts"

    def teardown(self) -> None:
        for request in self.live.values():
            self.kv.free(request)
        self.kv.check_integrity()
        assert self.kv.num_free_blocks == NUM_BLOCKS - 1, "blocks leaked"
        assert self.kv.usage == 0.0


KVMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVMachine = KVMachine.TestCase
