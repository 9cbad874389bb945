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
    new_token_ids: list[int]  # PENDING_TOKEN where the token is still in flight


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
            if self._finishes_on_pending(request):
                i += 1  # its last token is in flight: nothing more to compute
                continue
            num_new = min(
                request.num_tokens_with_pending - request.num_computed_tokens, step.budget
            )
            while not self.kv.allocate_slots(request, num_new):
                # Victims come from the end, which is never already scheduled this step.
                victim = self.running.pop()
                self._preempt(victim)
                step.preempted_ids.append(victim.request_id)
                if victim is request:
                    # It was the last one: it waits until blocks free up. Admission checked
                    # that a lone request always fits, so this cannot last forever.
                    return
            self._emit(step, request, num_new)
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

    def _emit(self, step: _StepBuilder, request: Request, num_new: int) -> None:
        start = request.num_computed_tokens
        end = start + num_new
        known = request.all_token_ids[start:end]
        samples = end == request.num_tokens_with_pending
        step.scheduled.append(
            ScheduledRequest(
                request=request,
                num_computed_tokens=start,
                num_new_tokens=num_new,
                block_ids=self.kv.get_block_ids(request.request_id),
                samples=samples,
                new_token_ids=known + [PENDING_TOKEN] * (num_new - len(known)),
            )
        )
        request.num_computed_tokens = end
        request.num_pending_tokens += samples
        step.num_new[request.request_id] = num_new
        step.budget -= num_new

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    # -- after the model ran ------------------------------------------------------------------

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance the step's requests, append sampled tokens and finish those that stop.

        `sampled` maps request id to the token sampled for every scheduled request whose
        `samples` is True. Requests finished or aborted since `schedule()` are skipped. Returns
        the requests that finished in this call, their blocks already freed.
        """
        finished: list[Request] = []
        for item in output.scheduled:
            request = item.request
            if self.requests.get(request.request_id) is not request:
                continue  # finished by finish_requests() while the step ran
            if request.status is RequestStatus.RUNNING:
                # Every input token of this step is known by now (a pending one landed with
                # the step before), so its full blocks can enter the prefix cache.
                self.kv.cache_blocks(request, item.num_computed_tokens + item.num_new_tokens)
            if not item.samples:
                continue
            # A request preempted after this step was launched still gets the token: it was
            # computed from a valid cache, and recompute will cover it.
            request.num_pending_tokens -= 1
            try:
                token = sampled[request.request_id]
            except KeyError:
                raise KeyError(
                    f"no sampled token for {request.request_id!r}, which was scheduled to sample"
                ) from None
            request.append_output_token(token)
            status = self._check_stop(request, token)
            if status is not None:
                if request.status is not RequestStatus.RUNNING:
                    self.waiting.remove(request)  # preempted while its last step ran
                self._finish(request, status)
                finished.append(request)
        if finished:
            # One pass instead of a list.remove per finished request.
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return finished

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
            assert r.num_computed_tokens <= r.num_tokens_with_pending, (
                f"{r.request_id} computed past its tokens"
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
            assert not self.kv.has_blocks(r.request_id), f"{r.request_id} waits holding blocks"
        for gid, leader in self._leaders.items():
            assert self.requests.get(leader.request_id) is leader, f"group {gid}: leader is gone"
