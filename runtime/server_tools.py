"""Structured output, tools and reasoning at the API edge: which constraint a request asks
for, the grammar a `tool_choice` implies, and an answer's text turned into OpenAI's message
(content, reasoning_content, tool_calls), whole or as streamed deltas.

How tool_choice works (vLLM's behaviour):
- `none`: no tool calls; the template still sees the tools.
- `auto` (the default when tools are given): the model decides; its own format is parsed by the
  server's `--tool-call-parser` (runtime/tool_parsers.py), which needs
  `--enable-auto-tool-choice`.
- `required`: a grammar forces a JSON array of calls `[{"name": ..., "parameters": {...}}]`,
  one of each tool's name and parameter schema per item (at most one item without
  parallel_tool_calls); no parser is needed.
- a named function: a grammar forces that function's parameter schema; the output is its
  arguments.
A message that carries tool calls ends with finish_reason "tool_calls" (unless the length limit
cut it); OpenAI answers "stop" for a named choice, which agents then have to special-case.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

from compile_engine.runtime.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
)
from compile_engine.runtime.sampling_params import InvalidSamplingParams, StructuredOutputsParams
from compile_engine.runtime.tool_parsers import (
    ToolCall,
    ToolCallDelta,
    ToolCallParseError,
    ToolParser,
    new_call_id,
    parse_json_tool_calls,
)

_NO_PARAMETERS = {"type": "object", "properties": {}}


def structured_spec(
    req: CompletionRequest | ChatCompletionRequest,
) -> StructuredOutputsParams | None:
    """The request's output constraint, from whichever one field gives it; a 400 naming the
    fields when it gives several."""
    given: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        given.append(("response_format", {"json": fmt.json_schema.schema_}))
    if req.structured_outputs is not None:
        # vLLM's extra; its options that change nothing here are accepted and ignored.
        fields = {
            k: v
            for k, v in req.structured_outputs.items()
            if k
            not in ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
        }
        given.append(("structured_outputs", fields))
    for name, key in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        if getattr(req, name) is not None:
            given.append((name, {key: getattr(req, name)}))
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise APIError(
            400,
            f"{names} each constrain the output; send one of them",
            param=given[1][0],
            code="invalid_value",
        )
    param, fields = given[0]
    return _spec(fields, param)


def _spec(fields: dict[str, Any], param: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields, param=param)
    except TypeError:
        known = "json, regex, choice, grammar, json_object"
        raise APIError(
            400,
            f"{param} takes one of {known}; got {', '.join(sorted(fields))}",
            param=param,
            code="invalid_value",
        ) from None
    except InvalidSamplingParams as exc:
        raise APIError(400, str(exc), param=param, code="invalid_value") from None


@dataclass(slots=True)
class ToolPlan:
    """What a chat request's tools mean for its generation and its answer."""

    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]] | None  # for the chat template
    name: str | None = None  # the named function
    spec: StructuredOutputsParams | None = None  # the grammar of required / named
    parser: type[ToolParser] | None = None  # auto's


def tool_plan(
    req: ChatCompletionRequest, parser: type[ToolParser] | None, auto_enabled: bool
) -> ToolPlan:
    """Decide the request's tool handling; a 400 for what this server is not set up for."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice not in ("none", "auto") and not tools:
        raise APIError(400, "this tool_choice needs tools", param="tool_choice")
    functions = {t.function.name: t.function for t in req.tools or ()}
    if isinstance(choice, NamedToolChoice) and choice.function.name not in functions:
        raise APIError(
            400,
            f"tool_choice names {choice.function.name!r}, which is not one of the tools "
            f"({', '.join(functions)})",
            param="tool_choice",
        )
    if not tools or choice == "none":
        return ToolPlan("none", tools)
    constrained = structured_spec(req) is not None
    if choice == "auto":
        if not auto_enabled or parser is None:
            raise APIError(
                400,
                '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                'and --tool-call-parser; send tool_choice "required", a named function, or '
                '"none"',
                param="tool_choice",
                code="invalid_value",
            )
        return ToolPlan("auto", tools, parser=parser)
    if constrained:
        raise APIError(
            400,
            "tool_choice required or a named function constrains the output itself; leave "
            "response_format and the structured output fields out",
            param="tool_choice",
            code="invalid_value",
        )
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        schema = functions[name].parameters or _NO_PARAMETERS
        return ToolPlan("named", tools, name, _spec({"json": schema}, "tools"))
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"const": name},
                "parameters": function.parameters or _NO_PARAMETERS,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, function in functions.items()
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
    if not req.parallel_tool_calls:
        schema["maxItems"] = 1
    return ToolPlan("required", tools, spec=_spec({"json": schema}, "tools"))


def _call_body(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _delta_body(delta: ToolCallDelta) -> dict[str, Any]:
    body: dict[str, Any] = {"index": delta.index}
    function: dict[str, Any] = {"arguments": delta.arguments}
    if delta.id is not None:
        body |= {"id": delta.id, "type": "function"}
    if delta.name is not None:
        function = {"name": delta.name} | function
    return body | {"function": function}


def chat_message(text: str, plan: ToolPlan, reasoning: type | None) -> tuple[dict[str, Any], bool]:
    """The assistant message of a whole answer, and whether it calls tools."""
    message: dict[str, Any] = {"role": "assistant"}
    content: str | None = text
    if reasoning is not None:
        thinking, content = reasoning().parse(text)
        message["reasoning_content"] = thinking
    calls: list[ToolCall] = []
    if plan.mode == "named":
        calls, content = [ToolCall(new_call_id(), plan.name, content or "")], None
    elif plan.mode == "required":
        # Cut short by max_tokens, the output is no array: the text is the answer.
        with contextlib.suppress(ToolCallParseError):
            calls, content = parse_json_tool_calls(content or ""), None
    elif plan.mode == "auto":
        parsed = plan.parser(plan.tools).parse(content or "")
        calls, content = parsed.tool_calls, parsed.content
    message["content"] = content if (content or not calls) else None
    if calls:
        message["tool_calls"] = [_call_body(c) for c in calls]
    return message, bool(calls)


@dataclass(slots=True)
class ChatStream:
    """One choice's streamed deltas: the text through the reasoning parser, then the tool
    handling, as `chat_message` treats the whole text."""

    plan: ToolPlan
    reasoning: Any = None  # a ReasoningParser instance
    tools: Any = None  # auto's ToolParser instance, or required's _ForcedCalls
    called: bool = False
    _named_started: bool = False

    @classmethod
    def start(cls, plan: ToolPlan, reasoning: type | None) -> ChatStream:
        tools: Any = None
        if plan.mode == "auto":
            tools = plan.parser(plan.tools)
        elif plan.mode == "required":
            tools = _ForcedCalls()
        return cls(plan, reasoning() if reasoning is not None else None, tools)

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas (`delta` objects) that `text`, the answer's next piece, produces."""
        if self.reasoning is None:
            return self._answer(text, "")
        thinking, content = self.reasoning.feed(text)
        return self._answer(content, thinking)

    def finish(self) -> list[dict[str, Any]]:
        thinking = content = ""
        if self.reasoning is not None:
            thinking, content = self.reasoning.finish()
        deltas = self._answer(content, thinking)
        if self.plan.mode == "auto":
            text, calls = self.tools.finish()
            deltas += self._deltas(text, calls)
        return deltas

    def _answer(self, content: str, thinking: str) -> list[dict[str, Any]]:
        deltas = [{"reasoning_content": thinking}] if thinking else []
        if not content:
            return deltas
        mode = self.plan.mode
        if mode == "none":
            return deltas + [{"content": content}]
        if mode == "named":
            first = not self._named_started
            self._named_started = self.called = True
            call = ToolCallDelta(
                0, new_call_id() if first else None, self.plan.name if first else None, content
            )
            return deltas + [{"tool_calls": [_delta_body(call)]}]
        if mode == "required":
            return deltas + self._deltas("", self.tools.feed(content))
        text, calls = self.tools.feed(content)
        return deltas + self._deltas(text, calls)

    def _deltas(self, text: str, calls: list[ToolCallDelta]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = [{"content": text}] if text else []
        if calls:
            self.called = True
            deltas.append({"tool_calls": [_delta_body(c) for c in calls]})
        return deltas


@dataclass(slots=True)
class _ForcedCalls:
    """Streams the calls of a `tool_choice: required` answer, which its grammar makes exactly
    `[{"name":"f","parameters":{...}},...]` (compact JSON, keys in that order): each call's
    name once its string closes, then its parameters as they come."""

    index: int = -1
    state: str = "name"  # "name": looking for the next name; "args": inside parameters
    buffer: str = ""
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    pending: list[ToolCallDelta] = field(default_factory=list)

    _NAME = '{"name":'
    _ARGS = ',"parameters":'

    def feed(self, text: str) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        for ch in text:
            if self.state == "name":
                self.buffer += ch
                start = self.buffer.find(self._NAME)
                if start < 0:
                    continue
                rest = self.buffer[start + len(self._NAME) :]
                end = rest.find(self._ARGS)
                if end < 0:
                    continue
                self.index += 1
                name = json.loads(rest[:end])
                out.append(ToolCallDelta(self.index, new_call_id(), name, ""))
                self.state, self.buffer, self.depth = "args", "", 0
                continue
            # Inside the parameters object: pass it on character by character until it closes.
            out.append(ToolCallDelta(self.index, None, None, ch))
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.state = "name"
        return _merged(out)


def _merged(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive argument fragments of one call as one fragment."""
    merged: list[ToolCallDelta] = []
    for d in deltas:
        last = merged[-1] if merged else None
        if last is not None and d.id is None and d.name is None and last.index == d.index:
            last.arguments += d.arguments
        else:
            merged.append(ToolCallDelta(d.index, d.id, d.name, d.arguments))
    return merged
