"""The thinking part of an output, split from its answer, whole or streamed (issue #30).

`--reasoning-parser NAME` puts the text between `<think>` and `</think>` in
`message.reasoning_content` and the rest in `message.content`. Two formats, as vLLM names them:

- `deepseek_r1`: everything up to `</think>` is reasoning. The chat template usually puts the
  opening `<think>` in the prompt, so the output may or may not start with it; when it does it is
  stripped. An output without `</think>` (cut short) is all reasoning.
- `qwen3`: the output is `<think>...</think>` then content. An output that does not begin (after
  optional whitespace) with `<think>` is all content: thinking was switched off
  (`enable_thinking=False` puts an empty think block in the prompt). Models whose template puts
  `<think>` in the prompt (Qwen3-*-Thinking-2507, QwQ) therefore want `deepseek_r1`. Started but
  never closed (cut short), the rest is reasoning. The newlines the Qwen3 template writes around
  the tags are layout, not text: one "\\n" right after `<think>` and one right before `</think>`
  leave the reasoning, and up to two ("\\n\\n") right after `</think>` leave the content, as the
  template itself strips them when it renders a past turn. vLLM passes them through; clients
  then strip them, and a stream cannot be stripped after the fact, so it is done here.

`ended` turns true once the reasoning part is over (`</think>` seen, or for qwen3 the output
known not to start with `<think>`): from then on a grammar may constrain the answer. For qwen3
that decision needs the first non-space characters, which a grammar applied from the start would
itself constrain; when thinking is off the caller knows it from the request and should not wait.

Streaming equals parsing: for any split of the output, the reasoning and content deltas
concatenate to what `parse` returns (None read as ""); a tag cut across deltas is held back and
never leaks into either part.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "reasoning_parser",
]

_START = "<think>"
_END = "</think>"


def _held_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag` (to hold back)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _undecided_start(text: str) -> bool:
    """Whether `text` (stripped of leading space) may still become `<think>` with more output."""
    body = text.lstrip()
    return not body or (len(body) < len(_START) and _START.startswith(body))


class ReasoningParser:
    """One output's reasoning parser; a new instance per request (it keeps stream state)."""

    name: ClassVar[str]
    end_tag: ClassVar[str] = _END

    def __init__(self) -> None:
        self._ended = False

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """A whole output as (reasoning_content, content), each None when empty."""
        raise NotImplementedError

    def feed(self, delta: str) -> tuple[str, str]:
        """Take the next piece of output; return the (reasoning, content) text to send now."""
        raise NotImplementedError

    def finish(self) -> tuple[str, str]:
        """End of output: return whatever was held back."""
        raise NotImplementedError

    @property
    def ended(self) -> bool:
        """Whether the reasoning part is over, so that a grammar may start."""
        return self._ended


class DeepSeekR1ReasoningParser(ReasoningParser):
    """Reasoning up to `</think>`, an optional `<think>` first (DeepSeek-R1 and its distills)."""

    name = "deepseek_r1"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._state = "start"  # start (a leading <think>?) -> reasoning -> content

    def parse(self, text: str) -> tuple[str | None, str | None]:
        body = text.lstrip()
        body = body[len(_START) :] if body.startswith(_START) else text
        reasoning, end, content = body.partition(_END)
        return reasoning or None, (content or None) if end else None

    def feed(self, delta: str) -> tuple[str, str]:
        if self._state == "content":
            return "", delta
        self._buf += delta
        if self._state == "start":
            if _undecided_start(self._buf):
                return "", ""
            body = self._buf.lstrip()
            if body.startswith(_START):
                self._buf = body[len(_START) :]
            self._state = "reasoning"
        i = self._buf.find(_END)
        if i >= 0:
            reasoning, content = self._buf[:i], self._buf[i + len(_END) :]
            self._buf, self._state, self._ended = "", "content", True
            return reasoning, content
        cut = len(self._buf) - _held_suffix(self._buf, _END)
        reasoning, self._buf = self._buf[:cut], self._buf[cut:]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        # Whatever is held (a leading space, part of a tag) was reasoning: no </think> came.
        held, self._buf = self._buf, ""
        return held, ""


class Qwen3ReasoningParser(ReasoningParser):
    """`<think>...</think>` then content, or all content without a leading `<think>` (Qwen3)."""

    name = "qwen3"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        # start -> open (drop one "\n") -> reasoning -> after (drop up to two "\n") -> content;
        # or start -> content when the output does not open with <think>.
        self._state = "start"
        self._newlines_dropped = 0

    def parse(self, text: str) -> tuple[str | None, str | None]:
        body = text.lstrip()
        if not body.startswith(_START):
            return None, text or None
        body = body[len(_START) :]
        body = body.removeprefix("\n")
        reasoning, end, content = body.partition(_END)
        if not end:
            return reasoning or None, None
        reasoning = reasoning.removesuffix("\n")
        content = content[2:] if content.startswith("\n\n") else content.removeprefix("\n")
        return reasoning or None, content or None

    def feed(self, delta: str) -> tuple[str, str]:
        if self._state == "content":
            return "", delta
        self._buf += delta
        reasoning: list[str] = []
        while True:
            if self._state == "start":
                if _undecided_start(self._buf):
                    return "", ""
                body = self._buf.lstrip()
                if not body.startswith(_START):
                    self._ended, self._state = True, "content"  # thinking is off
                    out, self._buf = self._buf, ""
                    return "", out
                self._buf, self._state = body[len(_START) :], "open"
            elif self._state == "open":
                if not self._buf:
                    return "".join(reasoning), ""
                self._buf, self._state = self._buf.removeprefix("\n"), "reasoning"
            elif self._state == "reasoning":
                i = self._buf.find(_END)
                if i < 0:
                    keep = max(_held_suffix(self._buf, _END), _held_suffix(self._buf, "\n" + _END))
                    cut = len(self._buf) - keep
                    reasoning.append(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    return "".join(reasoning), ""
                reasoning.append(self._buf[:i].removesuffix("\n"))
                self._buf = self._buf[i + len(_END) :]
                self._ended, self._state = True, "after"
            else:  # after </think>: the template's "\n\n" is layout
                while self._newlines_dropped < 2 and self._buf.startswith("\n"):
                    self._buf = self._buf[1:]
                    self._newlines_dropped += 1
                if not self._buf and self._newlines_dropped < 2:
                    return "".join(reasoning), ""
                out, self._buf, self._state = self._buf, "", "content"
                return "".join(reasoning), out

    def finish(self) -> tuple[str, str]:
        held, self._buf = self._buf, ""
        if self._state == "start":
            return "", held  # a blank or a `<thi` output: no think block, so content
        if self._state == "reasoning":
            return held, ""  # part of "\n</think>" that never completed: still reasoning
        return "", ""  # open / after hold nothing; content holds nothing


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class for `--reasoning-parser NAME`; a ValueError names the known ones."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of: {known}") from None
