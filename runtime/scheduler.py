"""The token-budget scheduler. Plain Python, no torch (STYLE #7).

Every step hands out one budget of `max_num_batched_tokens` tokens. Each request's
`num_computed_tokens` chases its `num_tokens` (STYLE #8): a prompt is computed in chunks of
whatever budget is left (chunked prefill is always on), a decoding request needs one token, a
prefix-cache hit or a forked sibling prompt starts a request part-way, and preemption by
recompute simply resets `num_computed_tokens` to 0. A request whose prompt is scored (prompt
logprobs) takes no prefix-cache hit until its first token is out: every prompt row must run.

One step may be in flight while the next is scheduled (LLMEngine overlaps the host's work with
the device's): `schedule()` advances `num_computed_tokens` at once and counts each sampled token
as *pending* until `update_from_output` delivers it. A pending token is scheduled like a known
one; its id in `new_token_ids` is PENDING_TOKEN, which the runner fills from the device. Run
synchronously (update before the next schedule), nothing is ever pending at schedule time.

Speculative decoding adds draft tokens to a decode row (STYLE #8: they are scheduled tokens
like any other): a running request whose chunk reaches its last token, with nothing pending,
takes the drafts its proposer left in `Request.spec_token_ids` as far as the budget,
max_tokens and max_model_len allow, and gets KV slots for them, unless that needs a block the
pool can only give by preempting (then it runs without). `update_from_output` receives the
accepted drafts and the target's own token, rolls `num_computed_tokens` back past the rejected
drafts, frees the blocks beyond, and offers the prefix cache only blocks of accepted tokens. A
row verifying drafts is not scheduled again until its step lands (its length is unknown until
then); the engine steps synchronously while any request speculates.

Order within a step: running requests first, in admission order, then waiting ones first come
first served. When the KV pool runs dry for a running request, the most recently admitted running
request is preempted (its blocks freed, its generated tokens kept) and put at the front of the
waiting queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from compile_engine.runtime.kv_cache_manager import KVCacheManager
from compile_engine.runtime.request import Request, RequestStatus

# The id of a token sampled by a step still in flight; the runner reads its value on the device.
PENDING_TOKEN = -1


class InvalidSchedulerConfig(ValueError):
    """A scheduler setting is out of range; the message names it and what is allowed."""


class RequestTooLong(ValueError):
    """The request can never fit: its prompt plus max_tokens exceeds max_model_len or the pool."""


class QueueFull(RuntimeError):
    """The waiting queue is at max_waiting; retry later (a server answers 503)."""


class DuplicateRequest(ValueError):
    """A live request already has this id."""


@dataclass(slots=True)
class SchedulerConfig:
    max_model_len: int
    block_size: int
    num_blocks: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    # Bound on queued (never admitted) requests; None means unbounded. Preempted requests always
    # go back to the queue regardless, since dropping them would lose work already promised.
    max_waiting: int | None = None
    # Speculative decoding: the most drafts a row takes (0: off), and the acceptance below
    # which a request's proposals turn off, judged per window of offered drafts.
    num_speculative_tokens: int = 0
    min_acceptance_rate: float = 0.0
    acceptance_window: int = 16
    spec_disable_by_batch_size: int | None = None  # no drafts with this many running

    def __post_init__(self) -> None:
        def positive(name: str, minimum: int = 1) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise InvalidSchedulerConfig(
                    f"{name}={value!r} is invalid: must be an integer >= {minimum}"
                )

        positive("max_model_len")
        positive("block_size")
        positive("num_blocks", 2)
        positive("max_num_seqs")
        positive("max_num_batched_tokens")
        positive("num_speculative_tokens", 0)
        positive("acceptance_window")
        if self.max_waiting is not None:
            positive("max_waiting", 0)


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step; everything the model runner needs, complete when built."""

    request: Request
    num_computed_tokens: int  # at step start: positions of new_token_ids start here
    num_new_tokens: int
    block_ids: list[int]  # the request's whole block table after this step's allocation
    samples: bool  # this chunk reaches the last token: the runner samples one token
    new_token_ids: list[int]  # PENDING_TOKEN where the token is still in flight; drafts last
    # The drafts this row verifies (the last len() of new_token_ids): the runner samples at
    # each of the 1 + len() last positions and returns the accepted drafts and one more token.
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # in batch order
    num_batched_tokens: int
    preempted_ids: list[str]


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    # Speculative decoding, cumulative (vLLM's spec_decode_* counters): rows that verified
    # drafts, their draft tokens, the accepted ones, and those accepted at each position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _StepBuilder:
    budget: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    num_new: dict[str, int] = field(default_factory=dict)  # request id -> tokens this step


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; the last is preempted first
        self.requests: dict[str, Request] = {}  # every live (unfinished) request
        self._leaders: dict[str, Request] = {}  # group_id -> its live sibling 0
        self.num_preemptions_total = 0
        self.spec_num_drafts = self.spec_num_draft_tokens = self.spec_num_accepted = 0
        self.spec_accepted_per_pos = [0] * config.num_speculative_tokens

    # -- admission ----------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request, or raise RequestTooLong / QueueFull / DuplicateRequest."""
        cfg = self.config
        if request.request_id in self.requests:
            raise DuplicateRequest(f"request id {request.request_id!r} is already in flight")
        n_prompt = request.num_prompt_tokens
        if n_prompt == 0:
            raise RequestTooLong(f"request {request.request_id!r} has an empty prompt")
        if cfg.max_waiting is not None and len(self.waiting) >= cfg.max_waiting:
            raise QueueFull(
                f"{len(self.waiting)} requests are already waiting (max_waiting={cfg.max_waiting});"
                " retry later or raise max_waiting"
            )
        if n_prompt >= cfg.max_model_len:
            raise RequestTooLong(
                f"request {request.request_id!r} has {n_prompt} prompt tokens, which leaves no "
                f"room to generate within max_model_len={cfg.max_model_len}; shorten the prompt "
                f"to at most {cfg.max_model_len - 1} tokens"
            )
        if request.max_tokens is None:
            # No limit asked: as far as max_model_len and the pool both allow (a pool smaller
            # than one max_model_len sequence, e.g. --num-kv-blocks set low, would otherwise
            # refuse every such request; the last token needs no KV slot).
            room = min(cfg.max_model_len, (cfg.num_blocks - 1) * cfg.block_size + 1)
            request.max_tokens = max(room - n_prompt, 1)
        if n_prompt + request.max_tokens > cfg.max_model_len:
            raise RequestTooLong(
                f"request {request.request_id!r} has {n_prompt} prompt tokens and asks for "
                f"max_tokens={request.sampling_params.max_tokens}, but max_model_len is "
                f"{cfg.max_model_len}; shorten the prompt or set max_tokens <= "
                f"{cfg.max_model_len - n_prompt}"
            )
        # The last generated token is never fed back, so it needs no KV slot.
        blocks_needed = -(-(n_prompt + request.max_tokens - 1) // cfg.block_size)
        if blocks_needed > cfg.num_blocks - 1:
            raise RequestTooLong(
                f"request {request.request_id!r} may grow to {n_prompt + request.max_tokens} "
                f"tokens, which needs {blocks_needed} KV blocks of {cfg.block_size} tokens, but "
                f"the pool has only {cfg.num_blocks - 1} usable blocks; lower max_tokens or give "
                "the KV cache more memory"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if request.group_id is not None and request.sibling_index == 0:
            self._leaders[request.group_id] = request

    # -- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        step = _StepBuilder(budget=self.config.max_num_batched_tokens)
        self._schedule_running(step)
        # Admitting after a preemption would only thrash: the victim is at the queue's front.
        if not step.preempted_ids:
            self._schedule_waiting(step)
        return SchedulerOutput(
            scheduled=step.scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - step.budget,
            preempted_ids=step.preempted_ids,
        )

    def _schedule_running(self, step: _StepBuilder) -> None:
        i = 0
        while i < len(self.running) and step.budget > 0:
            request = self.running[i]
            if self._finishes_on_pending(request) or request.num_drafts_in_flight:
                # Its last token is in flight, or its length is (drafts being verified).
                i += 1
                continue
            num_new = min(
                request.num_tokens_with_pending - request.num_computed_tokens, step.budget
            )
            drafts = self._take_drafts(request, num_new, step.budget)
            if drafts and not self.kv.allocate_slots(request, num_new + len(drafts)):
                drafts = []  # speculation never preempts anyone
            num_new += len(drafts)
            while not self.kv.allocate_slots(request, num_new):
                # Victims come from the end, which is never already scheduled this step.
                victim = self.running.pop()
                self._preempt(victim)
                step.preempted_ids.append(victim.request_id)
                if victim is request:
                    # It was the last one: it waits until blocks free up. Admission checked
                    # that a lone request always fits, so this cannot last forever.
                    return
            self._emit(step, request, num_new, drafts)
            i += 1

    def _schedule_waiting(self, step: _StepBuilder) -> None:
        skipped: list[Request] = []  # siblings waiting for their leader's prompt
        while self.waiting and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_pending_tokens:
                break  # preempted while its step was in flight: admitted once that step lands
            leader = self._leader_of(request)
            # A sibling forks the leader's prompt blocks only once an earlier step has
            # written them: within one step, sequences must not read each other's new KV.
            done = (
                leader.num_computed_tokens - step.num_new.get(leader.request_id, 0) if leader else 0
            )
            if leader is not None and done < leader.num_prompt_tokens:
                skipped.append(self.waiting.popleft())
                continue
            if not self._admit(request, leader, step):
                break  # FCFS: nothing overtakes a request that does not fit
            self.waiting.popleft()
        self.waiting.extendleft(reversed(skipped))

    def _leader_of(self, request: Request) -> Request | None:
        """The running sibling 0 this request should fork from, if any."""
        if request.group_id is None or request.sibling_index == 0 or request.num_output_tokens:
            return None
        leader = self._leaders.get(request.group_id)
        if leader is None or leader.status is not RequestStatus.RUNNING:
            return None  # gone or preempted: admit normally rather than wait
        if leader.prompt_token_ids != request.prompt_token_ids:
            return None
        if leader.cache_salt != request.cache_salt:
            return None
        return leader

    def _take_drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The proposer's drafts that fit this step, taking them off the request: only after
        a chunk that reaches the last token with nothing pending, and no more than
        num_speculative_tokens, the budget left, the tokens max_tokens still allows after one,
        and max_model_len."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if not drafts or request.num_pending_tokens:
            return []
        if request.num_computed_tokens + num_new != request.num_tokens:
            return []
        room = min(
            len(drafts),
            self.config.num_speculative_tokens,
            budget - num_new,
            request.max_tokens - request.num_output_tokens - 1,
            self.config.max_model_len - request.num_tokens - 1,
        )
        return drafts[: max(room, 0)]

    def _admit(self, request: Request, leader: Request | None, step: _StepBuilder) -> bool:
        assert request.num_computed_tokens == 0
        if leader is not None:
            num_shared = self.kv.fork_prefix(leader, request)
            num_new = min(request.num_tokens - num_shared, step.budget)
            if not self.kv.allocate_slots(request, num_new):
                self.kv.free(request)
                request.num_computed_tokens = 0
                return False
            # A sibling's shared blocks are what vLLM's lookup would find cached.
            self.kv.count_lookup(request, num_shared)
        else:
            # A prompt that must be scored computes every token itself (Request docstring).
            skip = request.needs_prompt_logprobs
            hit_ids, num_hit = ([], 0) if skip else self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit, step.budget)
            if not self.kv.allocate_slots(request, num_new, hit_ids):
                return False
            request.num_computed_tokens = num_hit
            if not skip:
                self.kv.count_lookup(request, num_hit)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._emit(step, request, num_new)
        return True

    def _finishes_on_pending(self, request: Request) -> bool:
        """Whether a pending token already takes the request to max_tokens or max_model_len."""
        if not request.num_pending_tokens:
            return False
        return (
            request.num_output_tokens + request.num_pending_tokens >= request.max_tokens
            or request.num_tokens_with_pending >= self.config.max_model_len
        )

    def _emit(
        self, step: _StepBuilder, request: Request, num_new: int, drafts: list[int] = ()
    ) -> None:
        start = request.num_computed_tokens
        end = start + num_new
        known = request.all_token_ids[start : end - len(drafts)]
        samples = end - len(drafts) == request.num_tokens_with_pending
        pending = [PENDING_TOKEN] * (num_new - len(drafts) - len(known))
        step.scheduled.append(
            ScheduledRequest(
                request=request,
                num_computed_tokens=start,
                num_new_tokens=num_new,
                block_ids=self.kv.get_block_ids(request.request_id),
                samples=samples,
                new_token_ids=known + pending + list(drafts),
                draft_token_ids=list(drafts),
            )
        )
        request.num_computed_tokens = end
        request.num_pending_tokens += samples
        request.num_drafts_in_flight = len(drafts)
        step.num_new[request.request_id] = num_new
        step.budget -= num_new

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    # -- after the model ran ------------------------------------------------------------------

    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, list[int]]
    ) -> list[Request]:
        """Advance the step's requests, append sampled tokens and finish those that stop.

        `sampled` maps request id to the tokens of every scheduled request whose `samples` is
        True: one, or with drafts the accepted ones and then the target's own. A stop (eos, a
        stop token, max_tokens) ends the list there: the tokens after it are deleted from the
        list in place, so that the caller sees what the request holds. Requests finished or
        aborted since `schedule()` are skipped. Returns the requests that finished in this call,
        their blocks already freed.
        """
        finished: list[Request] = []
        for item in output.scheduled:
            request = item.request
            if self.requests.get(request.request_id) is not request:
                continue  # finished by finish_requests() while the step ran
            status, rejected = None, 0
            if item.samples:
                # A request preempted after this step was launched still gets its tokens: they
                # were computed from a valid cache, and recompute will cover them.
                request.num_pending_tokens -= 1
                request.num_drafts_in_flight = 0
                tokens = self._sampled(item, sampled)
                num_accepted = len(tokens) - 1
                if item.draft_token_ids:
                    self._count_drafts(request, len(item.draft_token_ids), num_accepted)
                    rejected = len(item.draft_token_ids) - num_accepted
                for kept, token in enumerate(tokens, 1):
                    request.append_output_token(token)
                    status = self._check_stop(request, token)
                    if status is not None:
                        del tokens[kept:]
                        break
            if request.status is RequestStatus.RUNNING:
                if rejected:
                    request.num_computed_tokens -= rejected
                    self.kv.trim(request)
                # Every input token of this step is known by now (a pending one landed with
                # the step before), so its full blocks can enter the prefix cache; of its
                # drafts, only the accepted ones.
                end = item.num_computed_tokens + item.num_new_tokens - rejected
                self.kv.cache_blocks(request, end)
            if status is not None:
                if request.status is not RequestStatus.RUNNING:
                    self.waiting.remove(request)  # preempted while its last step ran
                self._finish(request, status)
                finished.append(request)
        if finished:
            # One pass instead of a list.remove per finished request.
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return finished

    @staticmethod
    def _sampled(item: ScheduledRequest, sampled: dict[str, list[int]]) -> list[int]:
        rid = item.request.request_id
        try:
            tokens = sampled[rid]
        except KeyError:
            raise KeyError(f"no sampled token for {rid!r}, which was scheduled to sample") from None
        drafts = item.draft_token_ids
        if not 1 <= len(tokens) <= len(drafts) + 1 or tokens[:-1] != drafts[: len(tokens) - 1]:
            raise ValueError(
                f"{rid!r}: sampled {tokens} is not its accepted drafts of {drafts} and one token"
            )
        return tokens

    def _count_drafts(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted += num_accepted
        for pos in range(num_accepted):
            self.spec_accepted_per_pos[pos] += 1
        # The drafts the target judged: those accepted and the first it rejected (the ones
        # after it were never compared), so that the rate is a draft's acceptance whatever k
        # is: at k = 6, one draft accepted a step is 1 of 2 judged, not 1 of 6 offered.
        request.spec_window_offered += min(num_drafts, num_accepted + 1)
        request.spec_window_accepted += num_accepted
        cfg = self.config
        if request.spec_window_offered >= cfg.acceptance_window:
            rate = request.spec_window_accepted / request.spec_window_offered
            request.spec_disabled = rate < cfg.min_acceptance_rate
            request.spec_window_offered = request.spec_window_accepted = 0

    def speculating(self) -> bool:
        """Whether some live request may still get drafts (the engine then steps
        synchronously: proposing needs each request's last token on the host)."""
        cfg = self.config
        if not cfg.num_speculative_tokens:
            return False
        limit = cfg.spec_disable_by_batch_size
        if limit is not None and len(self.running) >= limit:
            return False
        return any(not r.spec_disabled for r in self.requests.values())

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        # The token just appended was sampled with num_output_tokens - 1 tokens before it; the
        # sampler masks stop tokens while that count is below min_tokens, and so do we.
        if request.num_output_tokens > params.min_tokens:
            if token == request.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_requests(
        self,
        request_ids: str | Iterable[str],
        status: RequestStatus = RequestStatus.FINISHED_ABORTED,
        stop_reason: int | str | None = None,
    ) -> list[Request]:
        """Finish requests now (abort, or a stop string the engine found after detokenizing).

        Unknown and already-finished ids are ignored. Returns the requests finished here.
        """
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        finished = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            if stop_reason is not None:
                request.stop_reason = stop_reason
            self._finish(request, status)
            finished.append(request)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Release a request; the caller takes it out of running or waiting."""
        request.status = status
        self.kv.free(request)
        del self.requests[request.request_id]
        if request.group_id is not None and self._leaders.get(request.group_id) is request:
            del self._leaders[request.group_id]

    # -- observability ------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            spec_num_drafts=self.spec_num_drafts,
            spec_num_draft_tokens=self.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.spec_num_accepted,
            spec_accepted_per_pos=list(self.spec_accepted_per_pos),
        )

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant of the scheduler or KV pool."""
        self.kv.check_integrity()
        bs = self.config.block_size
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in self.waiting]
        assert len(set(running_ids)) == len(running_ids), "a request is running twice"
        assert len(set(waiting_ids)) == len(waiting_ids), "a request is waiting twice"
        assert not set(running_ids) & set(waiting_ids), "a request is both running and waiting"
        assert set(running_ids) | set(waiting_ids) == set(self.requests), (
            "live requests and running+waiting disagree"
        )
        assert len(self.running) <= self.config.max_num_seqs, "more running than max_num_seqs"
        for r in self.running:
            assert self.requests[r.request_id] is r, f"{r.request_id}: stale object running"
            assert r.status is RequestStatus.RUNNING, f"{r.request_id} running as {r.status.name}"
            assert r.num_computed_tokens <= r.num_tokens_with_pending + r.num_drafts_in_flight, (
                f"{r.request_id} computed past its tokens"
            )
            assert not r.num_drafts_in_flight or r.num_pending_tokens, (
                f"{r.request_id} has drafts in flight but no step to verify them"
            )
            assert r.num_pending_tokens or r.num_computed_tokens < r.num_tokens, (
                f"{r.request_id} has nothing to compute and nothing in flight"
            )
            covered = len(self.kv.get_block_ids(r.request_id)) * bs
            assert covered >= r.num_computed_tokens, (
                f"{r.request_id}: {r.num_computed_tokens} computed tokens but blocks for {covered}"
            )
        for r in self.waiting:
            assert self.requests[r.request_id] is r, f"{r.request_id}: stale object waiting"
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), (
                f"{r.request_id} waiting as {r.status.name}"
            )
            assert r.num_computed_tokens == 0, f"{r.request_id} waits with computed tokens"
            assert not r.num_drafts_in_flight or r.num_pending_tokens, (
                f"{r.request_id} waits with drafts but no step in flight"
            )
            assert not self.kv.has_blocks(r.request_id), f"{r.request_id} waits holding blocks"
        for gid, leader in self._leaders.items():
            assert self.requests.get(leader.request_id) is leader, f"group {gid}: leader is gone"
