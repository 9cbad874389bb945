"""The engine's state of one sequence (a sibling of a request) beside its scheduler `Request`:
its incremental text, the deltas since its last output, its logprobs; and of one request's
group of siblings. Kept apart from runtime/engine.py so that the loop fits on a screen."""

from __future__ import annotations

from dataclasses import dataclass, field

from compile_engine.runtime.detokenizer import IncrementalDetokenizer
from compile_engine.runtime.model_runner import TokenLogprobs
from compile_engine.runtime.prompt_logprobs import PromptScores
from compile_engine.runtime.request import Request


@dataclass(slots=True)
class Sequence:
    """Engine-side state of one sibling: its scheduler request and its text."""

    request: Request
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[TokenLogprobs] | None
    delta_text: str = ""
    delta_tokens: list[int] = field(default_factory=list)
    finished_seen: bool = False

    def deliver(self, tokens: list[int], logprobs: list[TokenLogprobs] | None) -> int | None:
        """Take a step's new tokens (several when drafts were accepted) one by one. When a
        stop string ends the text, returns how many tokens came after the one that completes
        it (else None); they are dropped from the request too, which the scheduler had appended
        them to before the text was known."""
        for i, token in enumerate(tokens):
            self.delta_tokens.append(token)
            if self.logprobs is not None and logprobs is not None:
                self.logprobs.append(logprobs[i])
            if self.detokenizer is None:
                continue
            self.delta_text += self.detokenizer.update([token])
            if self.detokenizer.stopped:
                self.request.drop_output_tokens(len(tokens) - 1 - i)
                return len(tokens) - 1 - i
        return None


@dataclass(slots=True)
class Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[Sequence]
    arrival_time: float
    prompt_scores: PromptScores | None  # sibling 0's, which alone scores the shared prompt

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.sequences)

    @property
    def ready(self) -> bool:  # outputs wait for the prompt's scores (the first token brings them)
        return self.finished or self.prompt_scores is None or self.prompt_scores.complete
