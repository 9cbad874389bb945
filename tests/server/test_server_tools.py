"""runtime/server_tools.py without a server: the tool plan a request implies, and the streamed
deltas of each tool mode and of the reasoning split, which must assemble to the whole answer's
message however the text is cut (every character, every two-way split)."""

from __future__ import annotations

import json

import pytest

from compile_engine.runtime.protocol import APIError, ChatCompletionRequest
from compile_engine.runtime.reasoning_parsers import reasoning_parser
from compile_engine.runtime.server_tools import ChatStream, chat_message, tool_plan
from compile_engine.runtime.tool_parsers import tool_parser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "noop"}},
]


def _request(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS} | fields
    return ChatCompletionRequest.model_validate(body)


def _plan(**fields):
    return tool_plan(_request(**fields), tool_parser("hermes"), auto_enabled=True)


def test_plans():
    assert _plan(tool_choice="none").mode == "none"
    assert _plan().mode == "auto"  # the default when tools are given
    required = _plan(tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(required.spec.key()[1])
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    named = _plan(tool_choice={"type": "function", "function": {"name": "noop"}})
    assert named.mode == "named" and named.name == "noop"
    with pytest.raises(APIError, match="enable-auto-tool-choice"):
        tool_plan(_request(), None, auto_enabled=False)
    with pytest.raises(APIError, match="not one of the tools"):
        _plan(tool_choice={"type": "function", "function": {"name": "nope"}})


def _splits(text: str):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


def _streamed(plan, reasoning, pieces) -> dict:
    stream = ChatStream.start(plan, reasoning)
    deltas = [d for p in pieces for d in stream.feed(p)] + stream.finish()
    message = {"content": "", "reasoning_content": "", "calls": {}}
    for d in deltas:
        message["content"] += d.get("content", "")
        message["reasoning_content"] += d.get("reasoning_content", "")
        for call in d.get("tool_calls", []):
            slot = message["calls"].setdefault(call["index"], {"name": None, "arguments": ""})
            if "id" in call:
                assert call["id"].startswith("call_") and slot["name"] is None
                slot["name"] = call["function"]["name"]
            slot["arguments"] += call["function"]["arguments"]
    message["called"] = stream.called
    return message


def _whole(plan, reasoning, text) -> dict:
    message, called = chat_message(text, plan, reasoning)
    calls = {
        i: {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for i, c in enumerate(message.get("tool_calls", []))
    }
    return {
        "content": message["content"] or "",
        "reasoning_content": message.get("reasoning_content") or "",
        "calls": calls,
        "called": called,
    }


CASES = [
    ("required", None, '[{"name":"get_weather","parameters":{"city":"P{a}ris"}},'
                       '{"name":"noop","parameters":{}}]'),
    ("named", None, '{"city":"Oslo \\"x\\""}'),
    ("auto", None, 'Sure.<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'),
    ("auto", "deepseek_r1",
     'hmm</think>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'),
    ("none", "qwen3", "<think>\nplan\n</think>\n\nThe answer."),
]  # fmt: skip


@pytest.mark.parametrize("mode, reasoning, text", CASES)
def test_streams_assemble_to_the_whole_message(mode, reasoning, text):
    choice = {
        "required": "required",
        "named": {"type": "function", "function": {"name": "get_weather"}},
        "auto": "auto",
        "none": "none",
    }[mode]
    plan = _plan(tool_choice=choice)
    parser = reasoning_parser(reasoning) if reasoning else None
    whole = _whole(plan, parser, text)
    assert whole["called"] == (mode != "none")
    for pieces in _splits(text):
        streamed = _streamed(plan, parser, pieces)
        assert {k: streamed[k] for k in ("content", "reasoning_content", "called")} == {
            k: whole[k] for k in ("content", "reasoning_content", "called")
        }, pieces
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"].values()] == [
            (c["name"], json.loads(c["arguments"])) for c in whole["calls"].values()
        ], pieces


def test_required_cut_short_is_content():
    plan = _plan(tool_choice="required")
    message, called = chat_message('[{"name":"noop","para', plan, None)
    assert not called and message["content"] == '[{"name":"noop","para'
