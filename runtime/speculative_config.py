"""Speculative decoding's settings, vLLM's `speculative_config`: `LLM(...,
speculative_config={...})` or `--speculative-config '{json}'`. Torch-free, so that the command
line validates the flag before the heavy imports.

Methods: `ngram` (prompt lookup: the continuation of the most recent earlier occurrence of the
last n tokens, `prompt_lookup_min <= n <= prompt_lookup_max`, longest first), `draft_model`
(a smaller model with the same vocabulary, `model`, run beside the target with its own KV
cache), `eagle3` (an EAGLE-3 head, `model`, in the layout published for Llama-3.1-8B, over the
target's aux hidden states) and `mtp` (DeepSeek-V3's multi-token prediction layer from the
target's own checkpoint; `model` may name another directory holding it).
`eagle` (EAGLE-1 heads) is vLLM's name for heads this engine cannot load yet: it is refused
by name rather than taken for something else.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields

METHODS = ("ngram", "draft_model", "eagle3", "mtp")
NOT_IMPLEMENTED = ("eagle",)
# vLLM's default window when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5
MAX_SPECULATIVE_TOKENS = 16


class SpeculativeConfigError(ValueError):
    """A speculative_config setting is invalid; the message names it and what is allowed."""


@dataclass(slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # ngram: the lengths of the suffix looked up in the prompt and output (vLLM's: one bound
    # alone sets both; neither sets both to 5).
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # draft_model: its path or alias, and whether it runs eagerly (None: as the target does);
    # eagle3: the head's directory; mtp: none (the target's checkpoint) or the directory.
    model: str | None = None
    enforce_eager: bool | None = None
    # Ours (vLLM has none): a request whose drafts were accepted at less than this rate, once
    # the target has judged `acceptance_window` of its draft tokens (those accepted and the
    # first rejected of each verification), proposes nothing more, so that a
    # request speculation does not help costs what it costs without speculation; so does one
    # whose proposer found nothing `acceptance_window` steps in a row (no n-gram match), so
    # that the engine can step asynchronously again.
    min_acceptance_rate: float = 0.2
    acceptance_window: int = 16
    # vLLM's: no proposals in a step with at least this many running requests (None: always).
    disable_by_batch_size: int | None = None
    # Ours: each step's k (0..num_speculative_tokens) chosen from the engine's measured step
    # times and the per-position acceptance, 0 when drafts do not pay (runtime/spec_policy.py);
    # False: every step offers num_speculative_tokens.
    adaptive: bool = True

    def __post_init__(self) -> None:
        method = self.method
        if method in NOT_IMPLEMENTED:
            raise SpeculativeConfigError(
                f"method={method!r} is not implemented yet (its draft heads cannot be loaded); "
                f"use one of {', '.join(METHODS)}"
            )
        if method not in METHODS:
            raise SpeculativeConfigError(
                f"method={method!r} is not supported; use one of {', '.join(METHODS)}"
            )
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(
                f"num_speculative_tokens={k!r} is invalid: must be an integer in "
                f"[1, {MAX_SPECULATIVE_TOKENS}]"
            )
        if method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if value is not None and (not _is_int(value) or value < 1):
                    raise SpeculativeConfigError(
                        f"{name}={value!r} is invalid: must be an integer >= 1"
                    )
            if lo is None and hi is None:
                lo = hi = DEFAULT_PROMPT_LOOKUP
            self.prompt_lookup_min = lo = hi if lo is None else lo
            self.prompt_lookup_max = hi = lo if hi is None else hi
            if lo > hi:
                raise SpeculativeConfigError(
                    f"prompt_lookup_min={lo} exceeds prompt_lookup_max={hi}"
                )
            if self.model is not None:
                raise SpeculativeConfigError("model is a draft_model setting; ngram takes none")
        else:
            if method == "draft_model" and (not isinstance(self.model, str) or not self.model):
                raise SpeculativeConfigError(
                    "method='draft_model' needs model: the draft's path or alias"
                )
            if method == "eagle3" and (not isinstance(self.model, str) or not self.model):
                raise SpeculativeConfigError(
                    "method='eagle3' needs model: the EAGLE-3 head's directory"
                )
            if self.model is not None and not isinstance(self.model, str):
                raise SpeculativeConfigError(f"model={self.model!r}: must be a path")
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise SpeculativeConfigError(
                    f"prompt_lookup_min/max are ngram settings; {method} takes none"
                )
        if not isinstance(self.adaptive, bool):
            raise SpeculativeConfigError(f"adaptive={self.adaptive!r}: must be a bool")
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise SpeculativeConfigError(f"enforce_eager={self.enforce_eager!r}: must be a bool")
        rate = self.min_acceptance_rate
        if not isinstance(rate, int | float) or not math.isfinite(rate) or not 0 <= rate <= 1:
            raise SpeculativeConfigError(f"min_acceptance_rate={rate!r}: must be in [0, 1]")
        if not _is_int(self.acceptance_window) or self.acceptance_window < 1:
            raise SpeculativeConfigError(
                f"acceptance_window={self.acceptance_window!r}: must be an integer >= 1"
            )
        size = self.disable_by_batch_size
        if size is not None and (not _is_int(size) or size < 1):
            raise SpeculativeConfigError(f"disable_by_batch_size={size!r}: must be an integer >= 1")

    @classmethod
    def coerce(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a SpeculativeConfig, its dict, or the JSON the command line gives."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise SpeculativeConfigError(f"not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise SpeculativeConfigError(f"expected a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise SpeculativeConfigError(
                f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        for name in ("method", "num_speculative_tokens"):
            if name not in value:
                raise SpeculativeConfigError(f"{name} is required")
        return cls(**value)

    def to_dict(self) -> dict:
        return asdict(self)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
