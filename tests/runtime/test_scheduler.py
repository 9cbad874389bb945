"""Scheduler: focused cases, then a hypothesis state machine driving it like an engine would.

The machine plays the model runner: it checks every scheduled chunk against a shadow of what each
KV block slot would hold (the salt and token prefix that wrote it), feeds back random sampled
tokens (sometimes eos), aborts at random, and finally drains everything. For requests that score
their prompt (prompt logprobs) it plays the engine too: each landed chunk's scores go into the
request's PromptScores, which must hold every prompt token once, in order, when the first
token lands, whatever prefix hits, forks and preemptions happened.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from compile_engine.runtime.prompt_logprobs import PromptScores, scored_span
from compile_engine.runtime.request import Request, RequestStatus
from compile_engine.runtime.sampling_params import SamplingParams
from compile_engine.runtime.scheduler import (
    PENDING_TOKEN,
    DuplicateRequest,
    InvalidSchedulerConfig,
    QueueFull,
    RequestTooLong,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

EOS = 0


def make_request(
    rid: str,
    prompt: list[int],
    max_tokens: int | None = 16,
    *,
    salt: str | None = None,
    group: str | None = None,
    sibling: int = 0,
    **params: object,
) -> Request:
    return Request(
        rid,
        prompt,
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_id=EOS,
        cache_salt=salt,
        group_id=group,
        sibling_index=sibling,
    )


def make_scheduler(**overrides: object) -> Scheduler:
    fields: dict[str, object] = dict(
        max_model_len=256, block_size=16, num_blocks=64, max_num_batched_tokens=2048
    )
    fields.update(overrides)
    return Scheduler(SchedulerConfig(**fields))


def step(sched: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    sampled = {s.request.request_id: [token] for s in out.scheduled if s.samples}
    finished = sched.update_from_output(out, sampled)
    sched.check_integrity()
    return out, finished


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[Request]:
    finished: list[Request] = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return finished
        finished += step(sched)[1]
    raise AssertionError("scheduler made no progress")


def test_imports_no_torch() -> None:
    code = "import runtime.scheduler, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


def test_config_is_validated() -> None:
    with pytest.raises(InvalidSchedulerConfig, match="num_blocks=1"):
        SchedulerConfig(max_model_len=16, block_size=16, num_blocks=1)
    with pytest.raises(InvalidSchedulerConfig, match="max_num_seqs"):
        SchedulerConfig(max_model_len=16, block_size=16, num_blocks=8, max_num_seqs=0)


def test_chunked_prefill_splits_by_budget_and_samples_on_the_last_chunk() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("a", list(range(1, 41)), max_tokens=2))
    chunks = []
    for _ in range(3):
        out, _ = step(sched)
        (item,) = out.scheduled
        chunks.append((item.num_computed_tokens, item.num_new_tokens, item.samples))
        assert item.new_token_ids == list(range(1, 41))[item.num_computed_tokens :][:16]
        assert len(item.block_ids) * 16 >= item.num_computed_tokens + item.num_new_tokens
    assert chunks == [(0, 16, False), (16, 16, False), (32, 8, True)]
    out, finished = step(sched)
    assert (out.scheduled[0].num_new_tokens, out.scheduled[0].new_token_ids) == (1, [7])
    assert [r.request_id for r in finished] == ["a"]
    assert finished[0].output_token_ids == [7, 7]
    assert finished[0].finish_reason == "length"


def test_budget_is_shared_running_first_then_waiting_fcfs() -> None:
    sched = make_scheduler(max_num_batched_tokens=20)
    sched.add_request(make_request("a", [1] * 12))
    sched.add_request(make_request("b", [2] * 12))
    sched.add_request(make_request("c", [3] * 12))
    out, _ = step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("a", 12),
        ("b", 8),
    ]
    out, _ = step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("a", 1),
        ("b", 4),
        ("c", 12),
    ]
    assert out.num_batched_tokens == 17


def test_max_num_seqs_caps_the_batch() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        sched.add_request(make_request(rid, [1, 2, 3]))
    out, _ = step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"]
    assert sched.stats().num_waiting == 1


def test_too_long_is_rejected_with_the_numbers() -> None:
    sched = make_scheduler(max_model_len=100)
    with pytest.raises(RequestTooLong, match=r"90 prompt tokens.*max_tokens=20.*<= 10"):
        sched.add_request(make_request("a", [1] * 90, max_tokens=20))
    with pytest.raises(RequestTooLong, match="leaves no room"):
        sched.add_request(make_request("b", [1] * 100, max_tokens=None))
    small = make_scheduler(max_model_len=1000, num_blocks=5)  # 4 usable blocks: 64 tokens
    with pytest.raises(RequestTooLong, match="needs 5 KV blocks.*only 4 usable"):
        small.add_request(make_request("c", [1] * 60, max_tokens=10))
    small.add_request(make_request("d", [1] * 60, max_tokens=5))  # 64 slots: fits exactly
    assert not sched.has_unfinished_requests()


def test_max_tokens_none_fills_up_to_max_model_len() -> None:
    sched = make_scheduler(max_model_len=20)
    sched.add_request(make_request("a", [1] * 15, max_tokens=None))
    (done,) = run_to_completion(sched)
    assert done.num_tokens == 20 and done.finish_reason == "length"


def test_max_tokens_none_stops_where_a_small_pool_ends() -> None:
    # 4 usable blocks of 16 tokens hold 64 KV slots, less than one max_model_len sequence: a
    # request without max_tokens runs to 65 tokens (its last needs no slot), not refused.
    sched = make_scheduler(max_model_len=1000, num_blocks=5)
    sched.add_request(make_request("a", [1] * 60, max_tokens=None))
    (done,) = run_to_completion(sched)
    assert done.num_tokens == 65 and done.finish_reason == "length"
    with pytest.raises(RequestTooLong, match="needs 5 KV blocks.*only 4 usable"):
        sched.add_request(make_request("b", [1] * 65, max_tokens=None))  # the prompt alone


def test_bounded_waiting_queue_and_duplicate_ids() -> None:
    sched = make_scheduler(max_waiting=1)
    sched.add_request(make_request("a", [1]))
    with pytest.raises(DuplicateRequest):
        sched.add_request(make_request("a", [1]))
    with pytest.raises(QueueFull, match="max_waiting=1"):
        sched.add_request(make_request("b", [1]))
    step(sched)  # admits a: the queue has room again
    sched.add_request(make_request("b", [1]))


def test_stop_conditions() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("eos", [5]))
    sched.add_request(make_request("ignore", [5], max_tokens=3, ignore_eos=True))
    sched.add_request(make_request("min", [5], min_tokens=2))
    sched.add_request(make_request("stopid", [5], stop_token_ids=[9]))
    out = sched.schedule()
    finished = sched.update_from_output(
        out, {"eos": [EOS], "ignore": [EOS], "min": [EOS], "stopid": [9]}
    )
    assert {r.request_id: (r.finish_reason, r.stop_reason) for r in finished} == {
        "eos": ("stop", None),
        "stopid": ("stop", 9),
    }
    out = sched.schedule()
    assert sched.update_from_output(out, {"ignore": [EOS], "min": [EOS]}) == []
    out = sched.schedule()
    finished = sched.update_from_output(out, {"ignore": [EOS], "min": [EOS]})
    assert {r.request_id: r.finish_reason for r in finished} == {"ignore": "length", "min": "stop"}
    assert [len(r.output_token_ids) for r in finished] == [3, 3]
    assert not sched.has_unfinished_requests()
    sched.check_integrity()


def test_finish_requests_aborts_and_ignores_unknown_ids() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", [1] * 20))
    sched.add_request(make_request("b", [1] * 20))
    out = sched.schedule()
    done = sched.finish_requests(["a", "nope"])
    assert [r.finish_reason for r in done] == ["abort"]
    assert sched.finish_requests("a") == []
    # A request aborted while its step ran is skipped when the step's output comes back.
    assert [r.request_id for r in sched.update_from_output(out, {"a": [3], "b": [3]})] == []
    (stopped,) = sched.finish_requests("b", RequestStatus.FINISHED_STOPPED, stop_reason="\n\n")
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", "\n\n")
    assert sched.stats().kv_cache_usage == 0.0 and not sched.has_unfinished_requests()
    with pytest.raises(ValueError, match="finished status"):
        sched.finish_requests("b", RequestStatus.RUNNING)


def test_preemption_by_recompute_in_a_small_pool() -> None:
    # 6 usable blocks of 4 = 24 slots; two requests that each grow to 16 tokens cannot coexist.
    sched = make_scheduler(max_model_len=32, block_size=4, num_blocks=7, max_num_batched_tokens=64)
    sched.add_request(make_request("a", [1] * 6, max_tokens=10))
    sched.add_request(make_request("b", [2] * 6, max_tokens=10))
    finished: list[Request] = []
    preempted: list[str] = []
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        out, done = step(sched)
        preempted += out.preempted_ids
        finished += done
    assert preempted == ["b"] * len(preempted) and preempted
    assert sched.stats().num_preemptions_total == len(preempted)
    assert {r.request_id: len(r.output_token_ids) for r in finished} == {"a": 10, "b": 10}
    b = next(r for r in finished if r.request_id == "b")
    assert b.num_preemptions == len(preempted)
    assert sched.kv.num_free_blocks == 6


def test_preempted_request_resumes_at_the_front_and_recomputes_its_outputs() -> None:
    sched = make_scheduler(max_model_len=32, block_size=4, num_blocks=7, max_num_batched_tokens=64)
    sched.add_request(make_request("a", [1] * 6, max_tokens=10))
    sched.add_request(make_request("b", [2] * 6, max_tokens=10))
    while True:
        out, _ = step(sched)
        if out.preempted_ids:
            break
    b = sched.requests["b"]
    assert b.status is RequestStatus.PREEMPTED and sched.waiting[0] is b
    generated = b.num_output_tokens
    sched.add_request(make_request("c", [3]))
    while b.status is not RequestStatus.RUNNING:
        out, _ = step(sched)
    (item,) = [s for s in out.scheduled if s.request is b]
    # Prompt and outputs so far are fed again (minus what the prefix cache still holds).
    assert item.num_computed_tokens + item.num_new_tokens == 6 + generated
    assert item.new_token_ids == ([2] * 6 + [7] * generated)[item.num_computed_tokens :]


def test_prefix_hit_is_counted_for_a_shared_two_block_prefix() -> None:
    sched = make_scheduler()
    shared = list(range(100, 132))  # two blocks of 16
    sched.add_request(make_request("a", shared + [1, 2, 3], max_tokens=1))
    run_to_completion(sched)
    sched.add_request(make_request("b", shared + [4, 5], max_tokens=1))
    out, _ = step(sched)
    assert (out.scheduled[0].num_computed_tokens, out.scheduled[0].num_new_tokens) == (32, 2)
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (35 + 34, 32)
    # A different tenant gets nothing.
    sched.add_request(make_request("c", shared + [4, 5], max_tokens=1, salt="other"))
    out, _ = step(sched)
    assert out.scheduled[0].num_computed_tokens == 0


def test_prefix_counters_count_new_lookups_in_tokens_as_vllm_does() -> None:
    """vLLM's prefix_cache_queries / hits: the tokens of each new request's lookup and those
    found cached. A prompt that must be scored reads no hit and is not counted, a preempted
    request's re-lookup is not counted, a sibling's forked blocks count as hits, and with
    caching off nothing is counted."""
    shared = list(range(100, 132))  # two blocks of 16
    sched = make_scheduler()
    sched.add_request(make_request("a", shared + [1], max_tokens=1))
    run_to_completion(sched)
    sched.add_request(make_request("scored", shared + [2], max_tokens=1, prompt_logprobs=1))
    run_to_completion(sched)
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (33, 0)

    for i in range(2):
        sched.add_request(make_request(f"g{i}", shared + [3], 2, group="g", sibling=i))
    run_to_completion(sched)
    stats = sched.stats()
    # g0 hits the two cached blocks; g1 forks g0's two prompt blocks.
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (33 + 2 * 33, 2 * 32)

    off = make_scheduler(enable_prefix_caching=False)
    for i in range(2):
        off.add_request(make_request(f"g{i}", shared + [3], 2, group="g", sibling=i))
    run_to_completion(off)
    assert (off.stats().prefix_cache_queries, off.stats().prefix_cache_hits) == (0, 0)


def test_prefix_counters_skip_a_preempted_requests_relookup() -> None:
    sched = make_scheduler(max_model_len=32, block_size=4, num_blocks=7, max_num_batched_tokens=64)
    sched.add_request(make_request("a", [1] * 6, max_tokens=10))
    sched.add_request(make_request("b", [2] * 6, max_tokens=10))
    preempted = []
    while sched.has_unfinished_requests():
        preempted += step(sched)[0].preempted_ids
    assert preempted
    stats = sched.stats()
    # Counted once each, at first admission; b re-found its own blocks uncounted.
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (6 + 6, 0)


def test_siblings_wait_for_the_leader_then_share_its_prompt_blocks() -> None:
    for caching in (True, False):
        sched = make_scheduler(max_num_batched_tokens=16, enable_prefix_caching=caching)
        prompt = list(range(1, 41))
        for i in range(3):
            sched.add_request(make_request(f"g{i}", prompt, 4, group="g", sibling=i, seed=i))
        sched.add_request(make_request("other", [9, 9, 9]))
        out, _ = step(sched)
        # The siblings do not block an unrelated request behind them.
        assert [s.request.request_id for s in out.scheduled] == ["g0"]
        out, _ = step(sched)
        assert [s.request.request_id for s in out.scheduled] == ["g0"]
        out, _ = step(sched)  # g0 finishes its prompt; "other" takes the rest of the budget
        assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
            ("g0", 8),
            ("other", 3),
        ]
        out, _ = step(sched)
        assert [
            (s.request.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled
        ] == [("g0", 40, 1), ("other", 3, 1), ("g1", 32, 8), ("g2", 32, 6)]
        tables = [sched.kv.get_block_ids(f"g{i}") for i in range(3)]
        assert tables[0][:2] == tables[1][:2] == tables[2][:2]
        assert len({t[2] for t in tables}) == 3
        run_to_completion(sched)
        assert sched.kv.num_free_blocks == 63


def test_siblings_admit_normally_when_the_leader_is_gone() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    prompt = list(range(1, 41))
    for i in range(2):
        sched.add_request(make_request(f"g{i}", prompt, 4, group="g", sibling=i))
    step(sched)
    sched.finish_requests("g0")
    out, _ = step(sched)
    assert [(s.request.request_id, s.num_computed_tokens) for s in out.scheduled] == [("g1", 16)]


# -- speculative rows -------------------------------------------------------------------------


def spec_scheduler(**overrides: object) -> Scheduler:
    return make_scheduler(num_speculative_tokens=4, **overrides)


def decode_until_running(sched: Scheduler, request: Request) -> None:
    while request.num_computed_tokens != request.num_tokens - 1 or request.num_output_tokens == 0:
        step(sched)


def test_drafts_are_scheduled_tokens_and_rejection_rolls_back_and_frees_blocks() -> None:
    sched = spec_scheduler(block_size=4)
    a = make_request("a", [1] * 6, max_tokens=20)
    sched.add_request(a)
    decode_until_running(sched, a)
    assert a.num_tokens == 7 and sched.kv.get_block_ids("a").__len__() == 2
    a.spec_token_ids = [5, 6, 7, 8]
    out = sched.schedule()
    (item,) = out.scheduled
    assert (item.num_computed_tokens, item.num_new_tokens, item.samples) == (6, 5, True)
    assert item.new_token_ids == [7, 5, 6, 7, 8] and item.draft_token_ids == [5, 6, 7, 8]
    assert out.num_batched_tokens == 5 and len(item.block_ids) == 3  # slots for 11 tokens
    assert a.spec_token_ids == [] and a.num_drafts_in_flight == 4
    sched.check_integrity()
    # One draft accepted, then the target's own token: 7 + 2 tokens, 8 computed.
    sched.update_from_output(out, {"a": [5, 9]})
    assert a.output_token_ids[-2:] == [5, 9] and a.num_computed_tokens == 8
    assert sched.kv.get_block_ids("a") == item.block_ids[:2] and a.num_drafts_in_flight == 0
    stats = sched.stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens) == (1, 4)
    assert (stats.spec_num_accepted_tokens, stats.spec_accepted_per_pos) == (1, [1, 0, 0, 0])
    sched.check_integrity()
    out, _ = step(sched)
    assert out.scheduled[0].new_token_ids == [9]


def test_drafts_respect_budget_max_tokens_and_never_preempt() -> None:
    sched = spec_scheduler(max_num_batched_tokens=3)
    a = make_request("a", [1] * 6, max_tokens=20)
    sched.add_request(a)
    decode_until_running(sched, a)
    a.spec_token_ids = [5, 6, 7, 8]
    (item,) = sched.schedule().scheduled
    assert item.draft_token_ids == [5, 6]  # the budget of 3 holds the last token and two
    # max_tokens: with 2 tokens left, one draft at most (all accepted, plus one = 2).
    sched = spec_scheduler()
    b = make_request("b", [1] * 6, max_tokens=3)
    sched.add_request(b)
    decode_until_running(sched, b)
    assert b.num_output_tokens == 1
    b.spec_token_ids = [5, 6, 7, 8]
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == [5]
    (done,) = sched.update_from_output(out, {"b": [5, 6]})
    assert done.output_token_ids == [7, 5, 6] and done.finish_reason == "length"
    # A full pool: the drafts are dropped rather than preempt the other request.
    sched = spec_scheduler(block_size=4, num_blocks=5, max_model_len=16)
    c, d = make_request("c", [1] * 3, max_tokens=5), make_request("d", [2] * 11, max_tokens=5)
    sched.add_request(c)
    sched.add_request(d)
    decode_until_running(sched, c)
    c.spec_token_ids = [5, 6, 7, 8]
    out = sched.schedule()
    assert not out.preempted_ids and out.scheduled[0].draft_token_ids == []
    sched.check_integrity()


def test_a_stop_among_accepted_drafts_ends_the_list() -> None:
    sched = spec_scheduler()
    a = make_request("a", [1] * 6, max_tokens=20)
    sched.add_request(a)
    decode_until_running(sched, a)
    a.spec_token_ids = [5, EOS, 6]
    out = sched.schedule()
    tokens = [5, EOS, 6, 3]
    (done,) = sched.update_from_output(out, {"a": tokens})
    assert tokens == [5, EOS] and done.output_token_ids[-2:] == [5, EOS]
    assert done.finish_reason == "stop"
    sched.check_integrity()
    assert sched.kv.num_free_blocks == 63


def test_low_acceptance_turns_a_requests_proposals_off() -> None:
    sched = spec_scheduler(min_acceptance_rate=0.5, acceptance_window=8)
    a = make_request("a", [1] * 6, max_tokens=40)
    sched.add_request(a)
    decode_until_running(sched, a)
    assert sched.speculating()
    # A window counts the drafts the target judged: four drafts and none accepted are one
    # judged (the rest were never compared), one accepted of four is two.
    for accepted in ([5], [], [5], []):
        a.spec_token_ids = [5, 6, 7, 8]
        sched.update_from_output(sched.schedule(), {"a": [*accepted, 9]})
    assert not a.spec_disabled and a.spec_window_offered == 6 and a.spec_window_accepted == 2
    for _ in range(2):  # 8 judged, 2 accepted: a rate of 0.25, under 0.5
        a.spec_token_ids = [5, 6, 7, 8]
        sched.update_from_output(sched.schedule(), {"a": [9]})
    assert a.spec_disabled and not sched.speculating()
    crowded = spec_scheduler(spec_disable_by_batch_size=1)
    crowded.add_request(make_request("b", [1] * 6))
    assert crowded.speculating()  # waiting only
    step(crowded)
    assert not crowded.speculating()  # one running: at the batch size that turns drafts off


def test_rejected_drafts_never_enter_the_prefix_cache() -> None:
    sched = spec_scheduler(block_size=4)
    a = make_request("a", [1] * 7, max_tokens=20)
    sched.add_request(a)
    decode_until_running(sched, a)  # 8 tokens, 7 computed
    a.spec_token_ids = [5, 5, 5, 5]  # the last three would fill block 2 with 5s
    sched.update_from_output(sched.schedule(), {"a": [5, 9]})
    sched.check_integrity()  # checks every cached block's content against the request's tokens
    assert sorted(key[1] for key in sched.kv.pool.cached) == [(1, 1, 1, 1), (1, 1, 1, 7)]


# -- state machine --------------------------------------------------------------------------

BLOCK_SIZE = 4
CONFIG = SchedulerConfig(
    max_model_len=48,
    block_size=BLOCK_SIZE,
    num_blocks=16,  # 15 usable: 60 slots, so long requests preempt one another
    max_num_seqs=4,
    max_num_batched_tokens=12,
    num_speculative_tokens=3,
    min_acceptance_rate=0.3,
    acceptance_window=4,
)
PROMPTS = st.builds(
    lambda head, tail: head + tail,
    st.sampled_from([[], [1] * 8, [1, 2] * 5]),
    st.lists(st.integers(1, 2), min_size=1, max_size=22),
)


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sched = Scheduler(CONFIG)
        self.added: set[str] = set()
        self.reported: set[str] = set()
        # (block, slot) -> (salt, token prefix) of the request that last wrote it.
        self.slots: dict[tuple[int, int], tuple[str | None, tuple[int, ...]]] = {}
        self.count = 0
        self.in_flight: list[tuple[SchedulerOutput, dict[str, int]]] = []
        self.pending: dict[str, list[list[int]]] = {}  # request id -> in-flight steps' tokens
        self.scores: dict[str, PromptScores] = {}  # of the requests that score their prompt
        self.scored_in_flight: list[dict[str, tuple[int, int]]] = []  # per launched step

    def _report(self, finished: list[Request]) -> None:
        for request in finished:
            assert request.is_finished
            assert request.request_id not in self.reported, f"{request.request_id} finished twice"
            self.reported.add(request.request_id)
            self.pending.pop(request.request_id, None)  # what is still in flight is dropped

    @rule(
        prompt=PROMPTS,
        max_tokens=st.integers(1, 30),
        salt=st.sampled_from([None, "t2"]),
        n=st.integers(1, 3),
        min_tokens=st.integers(0, 2),
        scored=st.booleans(),
    )
    def add(
        self,
        prompt: list[int],
        max_tokens: int,
        salt: str | None,
        n: int,
        min_tokens: int,
        scored: bool,
    ):
        self.count += 1
        group = f"q{self.count:04d}" if n > 1 else None
        for i in range(n):
            rid = f"q{self.count:04d}-{i}"
            min_tokens = min(min_tokens, max_tokens)
            request = make_request(
                rid,
                prompt,
                max_tokens,
                salt=salt,
                group=group,
                sibling=i,
                min_tokens=min_tokens,
                prompt_logprobs=1 if scored else None,
            )
            if request.needs_prompt_logprobs:
                self.scores[rid] = PromptScores(len(prompt))
            if len(prompt) + max_tokens > CONFIG.max_model_len:
                with pytest.raises(RequestTooLong):
                    self.sched.add_request(request)
                return
            self.sched.add_request(request)
            self.added.add(rid)

    @precondition(lambda self: len(self.in_flight) <= 1)
    @rule(data=st.data())
    def launch(self, data: st.DataObject) -> None:
        """Schedule a step while at most one other is in flight (the engine's overlap), run it
        on the model stand-in and draw its sampled tokens, which the host sees only at land."""
        running_before = {r.request_id for r in self.sched.running}
        # What each request's token list will be once every launched token lands.
        future = {
            rid: r.all_token_ids + [t for tokens in self.pending.get(rid, []) for t in tokens]
            for rid, r in self.sched.requests.items()
        }
        proposed = {}
        for r in self.sched.running:
            # A proposer's drafts of random length for requests whose last token is known.
            if r.num_pending_tokens or r.spec_disabled:
                continue
            drafts = data.draw(st.lists(st.integers(1, 2), min_size=1, max_size=4), label="drafts")
            r.spec_token_ids = proposed[r.request_id] = drafts
        out = self.sched.schedule()
        if out.preempted_ids:
            # No admissions in a step that preempted: the victim would just thrash back in.
            assert {s.request.request_id for s in out.scheduled} <= running_before
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= CONFIG.max_num_batched_tokens
        assert len(out.scheduled) <= CONFIG.max_num_seqs
        assert len({s.request.request_id for s in out.scheduled}) == len(out.scheduled)
        if out.preempted_ids:
            event("preempted")
        sampled = {}
        scored = {}
        for s in out.scheduled:
            rid, r = s.request.request_id, s.request
            if r.needs_prompt_logprobs:
                if rid not in running_before:
                    assert s.num_computed_tokens == 0, f"{rid} scores its prompt but took a hit"
                first, count = scored_span(r, s.num_computed_tokens, s.num_new_tokens)
                if count:
                    scored[rid] = (first, count)
                    event("a chunk scores prompt tokens")
            drafts = s.draft_token_ids
            if drafts:
                event("drafts scheduled")
                assert s.samples and drafts == proposed[rid][: len(drafts)]
                assert len(drafts) <= CONFIG.num_speculative_tokens
                assert r.num_output_tokens + len(drafts) < r.max_tokens
            tokens = future[rid] + drafts
            self._run_model(r, tokens, s.num_computed_tokens, s.num_new_tokens, s.block_ids)
            end = s.num_computed_tokens + s.num_new_tokens
            expected = [
                t if pos < r.num_tokens or pos >= len(future[rid]) else PENDING_TOKEN
                for pos, t in enumerate(tokens[s.num_computed_tokens : end], s.num_computed_tokens)
            ]
            assert s.new_token_ids == expected
            assert s.samples == (end == len(tokens))
            if PENDING_TOKEN in s.new_token_ids:
                event("a pending token scheduled")
            if s.samples:
                # The verifier accepts a random prefix of the drafts, then adds its own token.
                accepted = data.draw(st.integers(0, len(drafts)), label="accepted")
                token = data.draw(st.sampled_from([EOS, 1, 2, 2]), label="token")
                sampled[rid] = drafts[:accepted] + [token]
                self.pending.setdefault(rid, []).append(list(sampled[rid]))
            if s.num_computed_tokens and r.num_output_tokens == 0:
                event("started part-way (prefix hit or fork)")
        self.in_flight.append((out, sampled))
        self.scored_in_flight.append(scored)

    @precondition(lambda self: self.in_flight)
    @rule()
    def land(self) -> None:
        """The oldest launched step's tokens reach the host."""
        out, sampled = self.in_flight.pop(0)
        for rid, (first, count) in self.scored_in_flight.pop(0).items():
            if rid in self.scores and rid not in self.reported:
                if first < len(self.scores[rid].entries):
                    event("a recompute scores prompt tokens again")
                self.scores[rid].add(first, list(range(first, first + count)))
        for rid, tokens in sampled.items():
            if rid in self.pending:  # else it finished while this step was in flight
                assert self.pending[rid].pop(0) == tokens
        before = {s.request.request_id: s.request.num_output_tokens for s in out.scheduled}
        self._report(self.sched.update_from_output(out, sampled))
        for s in out.scheduled:
            r, rid = s.request, s.request.request_id
            if not s.samples or self.sched.requests.get(rid) is not r:
                continue
            # Exactly the tokens the list kept were appended; a rejection left the request's
            # blocks covering its accepted tokens only.
            assert r.output_token_ids[before[rid] :] == sampled[rid]
            if len(sampled[rid]) <= len(s.draft_token_ids) and r.status is RequestStatus.RUNNING:
                event("drafts rejected")
                assert r.num_computed_tokens == r.num_tokens - 1
                blocks = len(self.sched.kv.get_block_ids(rid))
                assert blocks == -(-r.num_computed_tokens // BLOCK_SIZE)
        for rid in sampled:
            if rid in self.scores and rid not in self.reported:
                # The engine's outputs wait for this: the first token brings the last scores.
                scores = self.scores[rid]
                assert scores.entries == [None, *range(1, scores.num_prompt_tokens)], rid

    def _run_model(
        self, request: Request, tokens: list[int], start: int, num_new: int, block_ids: list[int]
    ) -> None:
        """Check the chunk reads only KV of its own salt and prefix, then 'write' its own.
        Launch order is device order: a step's writes land before any later step reads."""
        assert len(block_ids) * BLOCK_SIZE >= start + num_new
        salt = request.cache_salt
        for pos in range(start):
            held = self.slots.get((block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE))
            assert held == (salt, tuple(tokens[: pos + 1])), f"{request.request_id} reads {pos}"
        for pos in range(start, start + num_new):
            block = block_ids[pos // BLOCK_SIZE]
            assert self.sched.kv.pool.blocks[block].ref_cnt == 1, "writes a shared block"
            self.slots[(block, pos % BLOCK_SIZE)] = (salt, tuple(tokens[: pos + 1]))

    @precondition(lambda self: self.added - self.reported)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.added - self.reported) + ["unknown"]))
        self._report(self.sched.finish_requests([rid]))

    @invariant()
    def integrity(self) -> None:
        self.sched.check_integrity()

    @invariant()
    def no_request_lost(self) -> None:
        assert set(self.sched.requests) == self.added - self.reported
        stats = self.sched.stats()
        assert stats.num_running + stats.num_waiting == len(self.added - self.reported)

    def teardown(self) -> None:
        for _ in range(2000):
            if not self.sched.has_unfinished_requests():
                break
            if len(self.in_flight) <= 1:
                self.launch(_FixedTokens())
            self.land()
        while self.in_flight:
            self.land()
        assert not self.sched.has_unfinished_requests(), "requests never finished"
        assert self.reported == self.added
        self.sched.check_integrity()
        assert self.sched.kv.num_free_blocks == CONFIG.num_blocks - 1, "blocks leaked"


class _FixedTokens:
    """Stands in for st.data() while draining in teardown: no drafts, every sampled token 2."""

    def draw(self, strategy: object, label: str | None = None) -> object:
        return {"drafts": [], "accepted": 0}.get(label, 2)


SchedulerMachine.TestCase.settings = settings(
    max_examples=75,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerMachine = SchedulerMachine.TestCase
