"""What a user asks of one generation. Plain Python: the scheduler and server import it too."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range; the message names it and the allowed range."""


GREEDY_BELOW = 1e-5  # temperatures below this sample greedily
MAX_LOGPROBS = 20  # top alternatives a position may return (OpenAI's and vLLM's default bound)


# The constraint kinds of StructuredOutputsParams, in the order a request's field is named.
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
MAX_CHOICES = 1024


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """vLLM's structured outputs: exactly one constraint the output must satisfy, enforced
    while decoding (runtime/structured_output.py). `json` is a JSON schema (a dict or its
    text), `regex` a regular expression (Rust regex syntax), `choice` the allowed outputs,
    `grammar` a Lark or GBNF/EBNF grammar, `json_object` any JSON object. `param` names the
    request field it came from, for error messages."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    param: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        chosen = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(chosen) != 1:
            raise InvalidSamplingParams(
                f"{self.param} needs exactly one of {', '.join(CONSTRAINTS)}; "
                + (f"got {', '.join(chosen)}" if chosen else "got none")
            )
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except ValueError as exc:
                raise InvalidSamplingParams(
                    f"{self.param}: the JSON schema is not JSON: {exc}"
                ) from None
            if not isinstance(parsed, dict | bool):
                raise InvalidSamplingParams(f"{self.param}: a JSON schema is an object")
        elif self.json is not None and not isinstance(self.json, dict):
            raise InvalidSamplingParams(f"{self.param}: a JSON schema is an object")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidSamplingParams(f"{self.param}: {name} must be a non-empty string")
        if self.choice is not None:
            if not self.choice or len(self.choice) > MAX_CHOICES:
                raise InvalidSamplingParams(
                    f"{self.param}: choice needs 1 to {MAX_CHOICES} strings"
                )
            if any(not isinstance(c, str) or not c for c in self.choice):
                raise InvalidSamplingParams(f"{self.param}: choices must be non-empty strings")

    @property
    def kind(self) -> str:
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))

    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar (the cache key)."""
        value: Any = getattr(self, self.kind)
        if isinstance(value, dict | tuple):
            value = json.dumps(value, sort_keys=True, ensure_ascii=False)
        return self.kind, str(value)


@dataclass(slots=True)
class SamplingParams:
    """Mirrors vLLM's SamplingParams for the fields this engine supports.

    temperature 0 means greedy, and so does any temperature below GREEDY_BELOW (as vLLM): the
    logits divided by 1e-40, which is 0 in float32, would be inf and NaN. top_k 0 or -1
    disables top-k. max_tokens None means "until max_model_len". Logprobs are those of the
    model's distribution (before penalties and temperature), the chosen token's plus the
    `logprobs` most likely ones. `prompt_logprobs=k` scores the prompt the same way: every
    prompt token but the first (which nothing precedes) gets its own logprob and the k most
    likely tokens at its position (`RequestOutput.prompt_logprobs`, None first).
    `structured_outputs` constrains the output to a JSON schema, regex, choice or grammar.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrained decoding; a dict is read as StructuredOutputsParams' fields.
    structured_outputs: StructuredOutputsParams | dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:  # an unknown field
                raise InvalidSamplingParams(f"structured_outputs: {exc}") from None
        self._check()

    def _check(self) -> None:
        def bad(name: str, rule: str) -> InvalidSamplingParams:
            return InvalidSamplingParams(f"{name}={getattr(self, name)!r} is invalid: {rule}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be a non-negative integer (0 or -1 disables it)")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be a finite number > 0 (1 disables it)")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", "must be an integer >= 1, or None for up to max_model_len")
        if self.min_tokens < 0 or (
            self.max_tokens is not None and self.min_tokens > self.max_tokens
        ):
            raise bad("min_tokens", "must be >= 0 and <= max_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            whole = isinstance(value, int) and not isinstance(value, bool)
            if value is not None and not (whole and 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {MAX_LOGPROBS}], or None")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def argmax_only(self) -> bool:
        """Greedy, with nothing that changes or reports its logits (no penalty, no logprobs):
        once its min_tokens are out, its token is the logits' argmax (the runner's fast path,
        no SamplingBatch). A grammar's mask the runner checks itself."""
        return self.greedy and self.logprobs is None and not self.needs_output_history

    @property
    def needs_output_history(self) -> bool:
        """Whether sampling reads the values of earlier outputs (penalties): such a request
        cannot be sampled while its previous token is still in flight."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
