"""One generation request as the scheduler sees it. Plain Python: no torch.

A request is a token list that grows. `num_computed_tokens` counts the tokens whose KV is in the
cache; the scheduler's only job is to make it chase `num_tokens` (STYLE #8). A prefill chunk, a
prefix-cache hit, a decode step and a recompute after preemption are all just "advance
num_computed_tokens".
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from compile_engine.runtime.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    # Back in the waiting queue after preemption by recompute: its blocks were freed and
    # num_computed_tokens reset, but the tokens it already generated are kept.
    PREEMPTED = 2
    # Everything from here on is finished; `is_finished` relies on this ordering.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_REJECTED = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI `finish_reason` string, or None while the request is not finished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_REJECTED: "abort",
}


@dataclass(slots=True, eq=False)
class Request:
    """The one request object shared by the engine, scheduler and KV cache manager.

    `all_token_ids` is the single growing list (prompt then outputs) that the hot path slices;
    `output_token_ids` is kept beside it so that detokenizing never copies the prompt. Both are
    appended to only through `append_output_token`.

    n > 1 arrives as n sibling requests with one `group_id`; sibling 0 computes the shared
    prompt and the others fork its KV blocks (see Scheduler).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    group_id: str | None = None
    sibling_index: int = 0
    # Resolved by the scheduler on admission (None in SamplingParams means "up to max_model_len").
    max_tokens: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    # Tokens whose KV is in the cache or is being written by a step already launched.
    num_computed_tokens: int = 0
    # Tokens sampled by launched steps whose values the host has not seen yet (0..2): with one
    # step in flight the scheduler plans the next step around them, and the runner feeds them
    # from the device (see Scheduler and LLMEngine.step).
    num_pending_tokens: int = 0
    num_preemptions: int = 0
    # Speculative decoding: the draft tokens proposed for the request's next step (set by the
    # proposer, taken by the scheduler, which may shorten them to fit), how many of a launched
    # step's scheduled tokens are drafts not yet verified, and the acceptance over the current
    # window of drafts, which turns proposals off when low (`spec_disabled`).
    spec_token_ids: list[int] = field(default_factory=list)
    num_drafts_in_flight: int = 0
    spec_window_offered: int = 0
    spec_window_accepted: int = 0
    spec_disabled: bool = False
    spec_steps_without_drafts: int = 0  # consecutive proposals that found nothing
    spec_idle: bool = False  # disabled for want of n-gram matches (looked up again each step)
    # The stop token id (stop_token_ids), the stop string (found by the engine), or None.
    stop_reason: int | str | None = None
    output_token_ids: list[int] = field(init=False)
    all_token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.output_token_ids = []
        self.all_token_ids = list(self.prompt_token_ids)
        if self.max_tokens is None:
            self.max_tokens = self.sampling_params.max_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Known tokens plus the pending ones: what `num_computed_tokens` chases."""
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether the prompt this request computes must be scored: sibling 0 of a request
        that asks for prompt logprobs (the siblings share one prompt and fork its blocks),
        until its first output token is out, by which time every prompt token's logprob has
        come back with the steps that computed it. Until then it reads no prefix-cache hit,
        whose blocks were computed by another request and scored by none (as vLLM does)."""
        return (
            self.sampling_params.prompt_logprobs is not None
            and self.sibling_index == 0
            and not self.output_token_ids
        )

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def drop_output_tokens(self, n: int) -> None:
        """Forget the last n output tokens: accepted drafts past a stop string the engine found
        after the scheduler had appended them (the request finishes at once)."""
        if n:
            del self.output_token_ids[-n:]
            del self.all_token_ids[-n:]
