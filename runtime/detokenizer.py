"""Token ids to streamed text: a short sliding decode window, then stop-string matching.

Two stages per `update`:

1. Decoding. Tokens are decoded in a window that starts a few tokens back, at a point where
   the ids end on a complete character, so that merges and leading spaces come out as in a
   full decode, while each step decodes only a handful of tokens. A byte-level token can end
   in the middle of a UTF-8 character; the tokenizer then decodes the unfinished bytes as
   U+FFFD. Trailing U+FFFD is therefore held back until a later token finishes the
   character (text before it is released at once). This relies on the decoder being lossy
   UTF-8 over the concatenated bytes, which makes everything before the unfinished bytes final.
   The first window starts with the prompt's last tokens: for byte-level BPE (Llama 3, Qwen,
   SmolLM2) that changes nothing, and for SentencePiece it keeps the leading space of the
   first output word that `decode(output_ids)` would strip but the continuation really has.

2. Stop strings. Text that could be the start of a stop string is held back until the next
   tokens decide it. A stop matches across token boundaries; the first stop to complete wins
   (ties: the one starting earliest), which makes the result independent of how the text was
   split into tokens. The text ends before the stop string (or after it, with
   include_stop_str_in_output). Like vLLM, stop strings only count once min_tokens tokens
   were generated.

`.text` is always the concatenation of everything `update` and `flush` returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from compile_engine.runtime.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded ahead of the output for spacing context; a handful is plenty.
_PROMPT_CONTEXT_TOKENS = 4
# The window is moved forward once it spans more tokens than this.
_MAX_WINDOW_TOKENS = 8


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text deltas. Plain Python, one per sequence."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stops = list(params.stop)
        self._longest_stop = max((len(s) for s in self._stops), default=0)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._num_tokens = 0

        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context)
        if context_text.endswith(_REPLACEMENT):
            # The prompt ends mid-character: the first output token would finish that
            # character inside the context, so the context would garble the output.
            context, context_text = [], ""
        self._ids = context  # [window context..., output tokens...]; only the tail is decoded
        self._start = 0  # the window is self._ids[self._start:]
        self._used = len(context_text)  # chars of the window's text already passed on
        self._boundary = len(context)  # latest index where the ids end on a whole character
        self._pending = ""  # decoded text held back because it may begin a stop string
        self._parts: list[str] = []
        self._text = ""
        self.stop_reason: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    @property
    def text(self) -> str:
        """The output text released so far; never contains a stop string (unless asked)."""
        if self._parts:
            self._text += "".join(self._parts)
            self._parts.clear()
        return self._text

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Add the step's tokens (usually one); return the text that became final.

        After a stop string matched, `.stopped` is True and further tokens are ignored.
        """
        if self.stopped:
            return ""
        self._num_tokens += len(new_token_ids)
        self._pending += self._decode_new(new_token_ids)
        return self._release(final=False)

    def flush(self) -> str:
        """Release everything held back; call once when generation ends for another reason
        (length, eos, stop token), so that an unfinished character or a prefix of a stop
        string still reaches the user."""
        if self.stopped:
            return ""
        window_text = self._decode(self._ids[self._start :])
        self._pending += window_text[self._used :]
        self._used = len(window_text)
        return self._release(final=True)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_new(self, new_token_ids: Sequence[int]) -> str:
        """Decoded text of the new tokens, minus unfinished characters at the end."""
        ids = self._ids
        ids.extend(new_token_ids)
        window_text = self._decode(ids[self._start :])
        end = len(window_text)
        while end > self._used and window_text[end - 1] == _REPLACEMENT:
            end -= 1
        new_text = window_text[self._used : end]
        self._used = end
        if end == len(window_text) and len(ids) > self._boundary:
            previous_boundary, self._boundary = self._boundary, len(ids)
            if len(ids) - self._start > _MAX_WINDOW_TOKENS:
                # Restart the window at the previous whole-character point, which leaves at
                # least the latest step's tokens as context for the next one.
                self._start = previous_boundary
                self._used = len(self._decode(ids[self._start :]))
        return new_text

    def _release(self, final: bool) -> str:
        pending = self._pending
        held = 0
        if self._stops and self._num_tokens >= self._min_tokens:
            match = self._first_stop(pending)
            if match is not None:
                at, stop = match
                self.stop_reason = stop
                self._pending = ""
                return self._emit(pending[: at + len(stop) if self._include_stop else at])
            if not final:
                held = self._stop_prefix_length(pending)
        cut = len(pending) - held
        self._pending = pending[cut:]
        return self._emit(pending[:cut])

    def _first_stop(self, pending: str) -> tuple[int, str] | None:
        """The stop string whose first occurrence ends first, earliest start on ties.

        Only the pending text needs searching: anything already released was not the start
        of a stop string, or it would have been held.
        """
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            at = pending.find(stop)
            if at >= 0 and (best is None or (at + len(stop), at) < best[:2]):
                best = (at + len(stop), at, stop)
        return None if best is None else (best[1], best[2])

    def _stop_prefix_length(self, pending: str) -> int:
        """Length of the longest suffix of `pending` that some stop string starts with."""
        for size in range(min(len(pending), self._longest_stop - 1), 0, -1):
            tail = pending[-size:]
            if any(stop.startswith(tail) for stop in self._stops):
                return size
        return 0

    def _emit(self, text: str) -> str:
        if text:
            self._parts.append(text)
        return text
