"""What the engine gives back: one RequestOutput per request and step that changed, with a
CompletionOutput per sibling (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from compile_engine.runtime.model_runner import TokenLogprobs


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    # What this step added, for streaming.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
