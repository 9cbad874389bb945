"""Tool calls out of a model's own output format, whole or streamed (#30, `tool_choice: auto`).

Three formats, named as vLLM's `--tool-call-parser` names them:

- `hermes` (Qwen2.5, Qwen3, Hermes):
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, any number in a row; the
  text around them is content.
- `llama3_json` (Llama 3.1/3.2): the whole output is `{"name": "f", "parameters": {...}}`,
  optionally after `<|python_tag|>`, several joined by `;`; anything else is plain text.
- `mistral`: content, then `[TOOL_CALLS]` and a JSON array `[{"name": "f", "arguments": {...}}]`,
  or the newer `[TOOL_CALLS]f[ARGS]{...}` (repeated for several calls).

Decisions, the same for every format:

- Malformed output never raises. A call whose JSON does not parse, lacks a string `name`, has
  arguments that are not an object, or whose tag is never closed, is content text, verbatim.
- A call is streamed once it is complete and checked, as one fragment carrying id, name and the
  whole arguments. Streaming a call's arguments while they are written would send fragments
  that a later check (a truncated output, a bad closing) must take back, which a stream cannot;
  guessing at partial JSON is how vLLM's hermes streaming drops a `}` (vllm#22885, #19056). The
  price is that a call's arguments arrive at its end rather than token by token. Held text is
  bounded by one call: hermes releases each call at `</tool_call>`; llama3_json and mistral,
  whose calls run to the end of the output by construction, release them at `finish`.
- Streaming equals parsing: for any split of the output into deltas, the content deltas
  concatenate to `parse(text).content` (`None` read as "") and the fragments assemble to its
  calls. A possible tag prefix at the end of a delta (`<tool_c`) is held back, never leaked.
- Whitespace-only text beside tool calls (the newlines between `</tool_call>` and `<tool_call>`)
  is dropped; an output with no call keeps its text verbatim. Streaming holds such whitespace
  until the next non-space character (sent with it) or the next call (dropped).
- A function name that is not in `tools` stays a call, as in vLLM: the client then sees what the
  model tried and can answer with an error message; dropping it would hide that.
- Arguments are re-serialised with `json.dumps(..., ensure_ascii=False)` from the parsed object
  (an `arguments` given as a JSON string holding an object is accepted too); `NaN`/`Infinity`
  are refused since they are not JSON and clients' parsers choke on them.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "TOOL_PARSERS",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "ParsedOutput",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParseError",
    "ToolParser",
    "parse_json_tool_calls",
    "tool_parser",
]


def new_call_id() -> str:
    """An OpenAI-shaped call id: "call_" and 24 hex characters, unique per call."""
    return "call_" + secrets.token_hex(12)


@dataclass(slots=True)
class ToolCall:
    """One complete call: what `message.tool_calls[i]` carries."""

    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class ToolCallDelta:
    """One OpenAI streaming fragment, `delta.tool_calls[i]`; id and name only on the first."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ParsedOutput:
    """A whole output split into its text (None when empty) and its calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ToolCallParseError(ValueError):
    """Text that had to be a list of tool calls (a grammar forced it) is not one."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads(text: str) -> Any:
    """json.loads, refusing NaN/Infinity; raises ValueError on anything that is not JSON."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError as exc:  # absurdly deep nesting from a looping model
        raise ValueError("JSON nested too deeply") from exc


def _call_from_object(obj: Any) -> ToolCall | None:
    """A ToolCall from `{"name": str, "arguments"|"parameters": {...}}`, or None if not that.

    A missing arguments key reads as `{}` (a function without parameters); arguments given as a
    JSON string are accepted when the string holds an object, which some fine-tunes write.
    """
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    if isinstance(args, str):
        try:
            args = _loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(id=new_call_id(), name=name, arguments=json.dumps(args, ensure_ascii=False))


def _call_from_json(text: str) -> ToolCall | None:
    try:
        return _call_from_object(_loads(text))
    except ValueError:
        return None


def _held_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag` (to hold back)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _as_deltas(calls: list[ToolCall], first_index: int) -> list[ToolCallDelta]:
    return [
        ToolCallDelta(index=first_index + i, id=c.id, name=c.name, arguments=c.arguments)
        for i, c in enumerate(calls)
    ]


class _WhitespaceGate:
    """Holds a text segment while it is only whitespace, so that it can be dropped at a call.

    The segment is the text since the last call. Once it shows a non-space character it is
    live and passes through; at a call a still-blank segment is dropped.
    """

    __slots__ = ("_pending", "_live")

    def __init__(self) -> None:
        self._pending = ""
        self._live = False

    def text(self, text: str) -> str:
        if self._live or not text:
            return text
        if text.strip():
            self._live = True
            out, self._pending = self._pending + text, ""
            return out
        self._pending += text
        return ""

    def call(self) -> None:
        self._pending = ""
        self._live = False

    def finish(self, called: bool) -> str:
        out = "" if called else self._pending
        self._pending = ""
        return out


def _content(segments: list[str], calls: list[ToolCall], text: str) -> str | None:
    """parse()'s content: the text verbatim without calls; with calls, the non-blank segments."""
    if calls:
        text = "".join(s for s in segments if s.strip())
    return text or None


class ToolParser:
    """One output's tool-call parser; a new instance per request (it keeps stream state).

    `tools` is the request's OpenAI `tools` list. It is kept for the names only: unknown names
    stay calls (see the module docstring), so no format needs it to parse.
    """

    name: ClassVar[str]

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = tools
        self.tool_names = {
            t.get("function", {}).get("name") for t in tools or () if isinstance(t, dict)
        }
        self._called = False
        self._index = 0

    def parse(self, text: str) -> ParsedOutput:
        """Split a whole output into content and calls."""
        raise NotImplementedError

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        """Take the next piece of output; return the content and call fragments to send now."""
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of output: return whatever was held back."""
        raise NotImplementedError

    @property
    def called(self) -> bool:
        """Whether the stream held a call so far (then finish_reason is "tool_calls")."""
        return self._called

    def _emit(self, calls: list[ToolCall]) -> list[ToolCallDelta]:
        deltas = _as_deltas(calls, self._index)
        self._index += len(calls)
        self._called = self._called or bool(calls)
        return deltas


class HermesToolParser(ToolParser):
    """`<tool_call>{json}</tool_call>` blocks among text (Qwen2.5, Qwen3, Hermes 2/3)."""

    name = "hermes"
    START: ClassVar[str] = "<tool_call>"
    END: ClassVar[str] = "</tool_call>"

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._gate = _WhitespaceGate()
        self._buf = ""  # outside a call: a held prefix of START
        self._in_call = False
        # Inside a call: its body so far in pieces, and the body's last len(END) - 1 characters,
        # so that each delta is searched once for END and a long call costs O(n), not O(n^2).
        self._parts: list[str] = []
        self._tail = ""

    def parse(self, text: str) -> ParsedOutput:
        start, end = self.START, self.END
        segments: list[str] = []
        calls: list[ToolCall] = []
        pos = seg_start = 0
        while (i := text.find(start, pos)) >= 0:
            j = text.find(end, i + len(start))
            if j < 0:
                break  # unterminated: the rest is text
            call = _call_from_json(text[i + len(start) : j])
            if call is not None:
                segments.append(text[seg_start:i])
                calls.append(call)
                seg_start = j + len(end)
            pos = j + len(end)  # a malformed block stays in the current text segment
        segments.append(text[seg_start:])
        return ParsedOutput(_content(segments, calls, text), calls)

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        start, end = self.START, self.END
        out: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if not self._in_call:
                text = self._buf + delta
                i = text.find(start)
                if i < 0:
                    cut = len(text) - _held_suffix(text, start)
                    out.append(self._gate.text(text[:cut]))
                    self._buf = text[cut:]
                    break
                out.append(self._gate.text(text[:i]))
                self._buf, delta = "", text[i + len(start) :]
                self._in_call, self._parts, self._tail = True, [], ""
                continue
            window = self._tail + delta
            j = window.find(end)
            if j < 0:
                self._parts.append(delta)
                self._tail = window[max(0, len(window) - (len(end) - 1)) :]
                break
            body = "".join(self._parts) + delta
            at = len(body) - len(window) + j
            body, delta = body[:at], body[at + len(end) :]
            self._in_call, self._parts, self._tail = False, [], ""
            call = _call_from_json(body)
            if call is None:
                out.append(self._gate.text(start + body + end))
            else:
                self._gate.call()
                deltas += self._emit([call])
        return "".join(out), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        held = self.START + "".join(self._parts) if self._in_call else self._buf
        self._buf, self._in_call, self._parts, self._tail = "", False, [], ""
        text = self._gate.text(held)
        return text + self._gate.finish(self._called), []


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1/3.2 JSON tool calling: the whole output is the call(s), or it is all text."""

    name = "llama3_json"
    TAG: ClassVar[str] = "<|python_tag|>"

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._held: list[str] = []
        self._passthrough = False  # decided: plain text
        self._decided_calls = False  # decided: maybe calls, held to the end

    def parse(self, text: str) -> ParsedOutput:
        calls = self._calls(text)
        if calls is None:
            return ParsedOutput(text or None, [])
        return ParsedOutput(None, calls)

    def _calls(self, text: str) -> list[ToolCall] | None:
        body = text.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].lstrip()
        if not body.startswith("{"):
            return None
        decoder = json.JSONDecoder(parse_constant=_reject_constant)
        calls: list[ToolCall] = []
        pos = 0
        while True:
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except (ValueError, RecursionError):
                return None
            call = _call_from_object(obj)
            if call is None:
                return None
            calls.append(call)
            rest = body[pos:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                return None
            if not rest:
                return calls
            pos = len(body) - len(rest)

    def _decide(self, text: str) -> bool | None:
        """Whether this start of output can still be calls: True, False, or None (undecided)."""
        body = text.lstrip()
        if not body or (len(body) < len(self.TAG) and self.TAG.startswith(body)):
            return None
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].lstrip()
            if not body:
                return None
        return body.startswith("{")

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        if self._passthrough:
            return delta, []
        self._held.append(delta)
        if self._decided_calls:
            return "", []
        held = "".join(self._held)
        self._held = [held]
        decision = self._decide(held)
        if decision is False:
            self._passthrough, self._held = True, []
            return held, []
        self._decided_calls = decision is True
        return "", []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self._passthrough:
            return "", []
        parsed = self.parse("".join(self._held))
        self._held = []
        return parsed.content or "", self._emit(parsed.tool_calls)


_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralToolParser(ToolParser):
    """Content, then `[TOOL_CALLS]` and the calls to the end of the output (Mistral models)."""

    name = "mistral"
    TAG: ClassVar[str] = "[TOOL_CALLS]"
    ARGS: ClassVar[str] = "[ARGS]"

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._gate = _WhitespaceGate()
        self._buf = ""  # a held tag prefix
        self._tail: list[str] | None = None  # after the tag: held to the end

    def parse(self, text: str) -> ParsedOutput:
        i = text.find(self.TAG)
        calls = None if i < 0 else self._calls(text[i + len(self.TAG) :])
        if calls is None:
            return ParsedOutput(text or None, [])
        return ParsedOutput(_content([text[:i]], calls, text), calls)

    def _calls(self, tail: str) -> list[ToolCall] | None:
        """The calls after the first tag, all or nothing: either JSON or `name[ARGS]{...}`s."""
        stripped = tail.strip()
        if stripped.startswith(("[", "{")):
            try:
                obj = _loads(stripped)
            except ValueError:
                return None
            objs = obj if isinstance(obj, list) else [obj]
            found = [_call_from_object(o) for o in objs]
            if not found or any(c is None for c in found):
                return None
            return [c for c in found if c is not None]
        calls: list[ToolCall] = []
        for piece in tail.split(self.TAG):
            name, sep, args = piece.partition(self.ARGS)
            name = name.strip()
            if not sep or not _MISTRAL_NAME.fullmatch(name):
                return None
            try:
                parsed = _loads(args)
            except ValueError:
                return None
            call = _call_from_object({"name": name, "arguments": parsed})
            if call is None:
                return None
            calls.append(call)
        return calls

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        if self._tail is not None:
            self._tail.append(delta)
            return "", []
        self._buf += delta
        i = self._buf.find(self.TAG)
        if i >= 0:
            text = self._gate.text(self._buf[:i])
            self._tail = [self._buf[i + len(self.TAG) :]]
            self._buf = ""
            return text, []
        cut = len(self._buf) - _held_suffix(self._buf, self.TAG)
        text, self._buf = self._gate.text(self._buf[:cut]), self._buf[cut:]
        return text, []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self._tail is None:
            text = self._gate.text(self._buf)
            self._buf = ""
            return text + self._gate.finish(False), []
        tail, self._tail = "".join(self._tail), None
        calls = self._calls(tail)
        if calls is None:
            text = self._gate.text(self.TAG + tail)
            return text + self._gate.finish(False), []
        self._gate.call()
        return self._gate.finish(True), self._emit(calls)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def tool_parser(name: str) -> type[ToolParser]:
    """The parser class for `--tool-call-parser NAME`; a ValueError names the known ones."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of: {known}") from None


def parse_json_tool_calls(text: str) -> list[ToolCall]:
    """The calls of a `tool_choice: required` or named-function output.

    A grammar forced that output to be `[{"name": ..., "parameters": {...}}, ...]`, so anything
    else means the output was cut short (max_tokens) or the grammar was not applied: that raises
    ToolCallParseError (a ValueError) for the caller to turn into content or an error. "arguments"
    is accepted for "parameters", and a lone object for a one-element array.
    """
    try:
        obj = _loads(text)
    except ValueError as exc:
        raise ToolCallParseError(f"tool-call output is not JSON: {exc}") from None
    objs = obj if isinstance(obj, list) else [obj]
    calls: list[ToolCall] = []
    for i, o in enumerate(objs):
        call = _call_from_object(o)
        if call is None:
            raise ToolCallParseError(
                f"tool call {i} is not an object with a string name and object parameters"
            )
        calls.append(call)
    return calls
