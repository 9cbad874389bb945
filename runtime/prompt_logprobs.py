"""Prompt logprobs: which prompt tokens a step's chunk scores, and one request's scores gathered
in prompt order. Plain Python: the scheduler's property tests drive it beside the scheduler.

The logprob of prompt token j comes from the logits of position j - 1, so a chunk that computes
positions [start, end) of a P-token prompt scores tokens start + 1 .. min(end, P - 1); token 0
has nothing before it and no score. A request that scores its prompt reads no prefix-cache hit
(`Request.needs_prompt_logprobs`): every prompt position runs through its own chunks. Preempted
part-way, it recomputes from token 0, so its later chunks score tokens it already holds; the
collector keeps the first score of each token and drops the repeats. A chunk that would leave a
hole is a bug and raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from compile_engine.runtime.request import Request


def scored_span(request: Request, start: int, num_new: int) -> tuple[int, int]:
    """(first prompt token scored, how many) by the chunk of `request` that computes positions
    [start, start + num_new); none when the request does not score its prompt now."""
    if not request.needs_prompt_logprobs:
        return start + 1, 0
    end = min(start + num_new, request.num_prompt_tokens - 1)
    return start + 1, max(end - start, 0)


@dataclass(slots=True)
class PromptScores:
    """One request's prompt logprobs as they come back, chunk by chunk: `entries[j]` is token
    j's (a TokenLogprobs; None for token 0)."""

    num_prompt_tokens: int
    entries: list[Any] = field(default_factory=lambda: [None])

    def add(self, first: int, scores: Sequence[Any]) -> None:
        """Take the scores of tokens first, first + 1, ...; those already held are repeats of
        a recompute and are dropped."""
        held = len(self.entries)
        if first > held:
            raise RuntimeError(
                f"prompt scores from token {first} arrived while tokens 0..{held - 1} are held: "
                "a chunk's scores were lost"
            )
        self.entries.extend(scores[held - first :])

    @property
    def complete(self) -> bool:
        return len(self.entries) == self.num_prompt_tokens
