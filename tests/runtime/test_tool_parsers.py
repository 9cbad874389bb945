"""Tool-call parsers: exact results on each format's outputs, and streaming equal to parsing
however the output is split (every character, every 2-way split, random splits)."""

from __future__ import annotations

import json
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compile_engine.runtime.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ToolCallDelta,
    ToolCallParseError,
    ToolParser,
    parse_json_tool_calls,
    tool_parser,
)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
CALL_ID = re.compile(r"call_[0-9a-f]{24}")

W = {"city": "Paris", "unit": "celsius"}
TRICKY = {
    "path": "a.py",
    "text": 'def f():\n    return {"k": [1, {}]}  # }}',
    "note": "café 你好 🎉",
}


def js(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False)


def hermes_call(name: str, args: object) -> str:
    return "<tool_call>\n" + js({"name": name, "arguments": args}) + "\n</tool_call>"


# (output, expected content, expected [(name, arguments object)])
HERMES = [
    ("The capital of France is Paris.", "The capital of France is Paris.", []),
    (hermes_call("get_weather", W), None, [("get_weather", W)]),
    (
        "Let me check both.\n"
        + hermes_call("get_weather", W)
        + "\n"
        + hermes_call("get_time", {"tz": "CET"})
        + "\n",
        "Let me check both.\n",
        [("get_weather", W), ("get_time", {"tz": "CET"})],
    ),
    # Braces inside strings, the tag's characters in text, unicode: nothing dropped.
    (hermes_call("write", TRICKY), None, [("write", TRICKY)]),
    ("Use a < b, <tool> or <tool_cal to", "Use a < b, <tool> or <tool_cal to", []),
    ("ends with a tag prefix <tool_c", "ends with a tag prefix <tool_c", []),
    # Malformed: invalid JSON, unterminated tag, no name, arguments not an object, NaN.
    (
        'Calling.<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',
        'Calling.<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',
        [],
    ),
    (
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}',
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}',
        [],
    ),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    (
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        [],
    ),
    (
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
        [],
    ),
    # A malformed block stays text while a later good one is a call.
    (
        "<tool_call>{oops}</tool_call> then " + hermes_call("get_time", {}),
        "<tool_call>{oops}</tool_call> then ",
        [("get_time", {})],
    ),
    # Text after a call is content; blank text beside calls is not.
    (
        hermes_call("get_time", {"x": 1}) + "\n\nDone.\n",
        "\n\nDone.\n",
        [("get_time", {"x": 1})],
    ),
    ("\n\n" + hermes_call("get_time", {}) + "\n \n", None, [("get_time", {})]),
    ("  \n", "  \n", []),
    ("", None, []),
    # Arguments as a JSON string, or absent.
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>', None, [("f", {"x": 2})]),
    ('<tool_call>{"name": "now"}</tool_call>', None, [("now", {})]),
    # An unknown function (not in TOOLS) stays a call, as in vLLM.
    (
        hermes_call("delete_everything", {"sure": True}),
        None,
        [("delete_everything", {"sure": True})],
    ),
    # A literal end tag inside an argument string ends the block first: malformed, so text.
    (
        '<tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}}</tool_call>',
        [],
    ),
]

LLAMA3 = [
    (js({"name": "get_weather", "parameters": W}), None, [("get_weather", W)]),
    (
        '<|python_tag|>{"name": "get_time", "parameters": {}}; '
        '{"name": "get_weather", "arguments": {"x": [1, 2]}}',
        None,
        [("get_time", {}), ("get_weather", {"x": [1, 2]})],
    ),
    ('  \n{"name": "f", "parameters": {"q": "naïve ☕ }"}};', None, [("f", {"q": "naïve ☕ }"})]),
    ("The answer is 4.", "The answer is 4.", []),
    ('{"answer": 4}', '{"answer": 4}', []),
    (
        '{"name": "f", "parameters": {"x": 1}} and some text',
        '{"name": "f", "parameters": {"x": 1}} and some text',
        [],
    ),
    ('{"name": "f", "parameters": {"x": 1', '{"name": "f", "parameters": {"x": 1', []),
    (
        '<|python_tag|>brave_search.call(query="x")',
        '<|python_tag|>brave_search.call(query="x")',
        [],
    ),
    ("<|pyth", "<|pyth", []),
    ("<|python_tag|>", "<|python_tag|>", []),
    (" \n", " \n", []),
    ("", None, []),
]

MISTRAL = [
    (
        "[TOOL_CALLS]"
        + js(
            [
                {"name": "get_weather", "arguments": W},
                {"name": "get_time", "arguments": {"tz": "CET"}},
            ]
        ),
        None,
        [("get_weather", W), ("get_time", {"tz": "CET"})],
    ),
    (
        'Sure, checking.[TOOL_CALLS] [{"name": "f", "arguments": {"a": "b}"}}]',
        "Sure, checking.",
        [("f", {"a": "b}"})],
    ),
    (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}',
        None,
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})],
    ),
    ("[TOOL_CALLS]" + js({"name": "f", "arguments": TRICKY}), None, [("f", TRICKY)]),
    ('\n[TOOL_CALLS][{"name": "f", "arguments": {}}]', None, [("f", {})]),
    ("Plain [TOOL_ text, no calls", "Plain [TOOL_ text, no calls", []),
    ("ends in [TOOL_CA", "ends in [TOOL_CA", []),
    (
        'Hi [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}',
        'Hi [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}',
        [],
    ),
    (
        '[TOOL_CALLS]f[ARGS]{"a": 1} trailing',
        '[TOOL_CALLS]f[ARGS]{"a": 1} trailing',
        [],
    ),
    ("[TOOL_CALLS]bad name[ARGS]{}", "[TOOL_CALLS]bad name[ARGS]{}", []),
    ("[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
    ("", None, []),
]

CASES = [(HermesToolParser, *c) for c in HERMES]
CASES += [(Llama3JsonToolParser, *c) for c in LLAMA3]
CASES += [(MistralToolParser, *c) for c in MISTRAL]
IDS = [f"{cls.name}-{i}" for i, (cls, *_) in enumerate(CASES)]


def stream(cls: type[ToolParser], chunks: list[str]) -> tuple[str, list[tuple[str, str]], bool]:
    """Feed the chunks; return the content, the assembled (name, arguments) calls, `called`.

    Checks the OpenAI fragment rules on the way: indexes count up from 0, id and name exactly
    on each call's first fragment, ids well formed and distinct.
    """
    parser = cls(TOOLS)
    content: list[str] = []
    frags: list[ToolCallDelta] = []
    for chunk in chunks:
        text, deltas = parser.feed(chunk)
        content.append(text)
        frags += deltas
    text, deltas = parser.finish()
    content.append(text)
    frags += deltas
    calls: list[list[str]] = []
    ids: list[str] = []
    for f in frags:
        if f.index == len(calls):
            assert f.id is not None and CALL_ID.fullmatch(f.id) and f.name
            ids.append(f.id)
            calls.append([f.name, f.arguments])
        else:
            assert f.index == len(calls) - 1 and f.id is None and f.name is None
            calls[-1][1] += f.arguments
    assert len(set(ids)) == len(ids)
    return "".join(content), [(n, a) for n, a in calls], parser.called


def check_stream(cls: type[ToolParser], text: str, chunks: list[str]) -> None:
    assert "".join(chunks) == text
    want = cls(TOOLS).parse(text)
    content, calls, called = stream(cls, chunks)
    assert content == (want.content or ""), chunks
    assert [n for n, _ in calls] == [c.name for c in want.tool_calls], chunks
    # Fragments concatenate to valid JSON equal to the call's arguments (no `}` dropped).
    assert [json.loads(a) for _, a in calls] == [json.loads(c.arguments) for c in want.tool_calls]
    assert called == bool(want.tool_calls)


@pytest.mark.parametrize(("cls", "text", "content", "calls"), CASES, ids=IDS)
def test_parse(cls, text, content, calls):
    got = cls(TOOLS).parse(text)
    assert got.content == content
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == calls
    for c in got.tool_calls:
        assert CALL_ID.fullmatch(c.id)
        assert c.arguments == js(json.loads(c.arguments))  # normalised, unicode kept
    assert len({c.id for c in got.tool_calls}) == len(got.tool_calls)


@pytest.mark.parametrize(("cls", "text", "content", "calls"), CASES, ids=IDS)
def test_stream_every_split(cls, text, content, calls):
    check_stream(cls, text, [text])
    check_stream(cls, text, list(text))  # one character at a time
    for at in range(len(text) + 1):
        check_stream(cls, text, [text[:at], text[at:]])


def test_stream_random_splits():
    @given(st.sampled_from(CASES), st.lists(st.integers(0, 400), max_size=8))
    @settings(max_examples=300, deadline=None)
    def run(case, cuts):
        cls, text, _, _ = case
        points = sorted({c % (len(text) + 1) for c in cuts})
        bounds = [0, *points, len(text)]
        check_stream(cls, text, [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])

    run()


def test_tag_prefix_never_leaks():
    # Content sent before a call is exactly the text before it, at every step.
    parser = HermesToolParser()
    text = "Hi <tool_call>" + js({"name": "f", "arguments": {}}) + "</tool_call>"
    sent = ""
    for ch in text:
        sent += parser.feed(ch)[0]
        assert "Hi <tool_call>".startswith(sent) and "<" not in sent
    assert sent == "Hi "
    parser = MistralToolParser()
    sent = "".join(parser.feed(ch)[0] for ch in 'ok[TOOL_CALLS][{"name": "f"}]')
    assert sent == "ok"


def test_hermes_call_streams_at_its_end_tag():
    # Each call goes out when its `</tool_call>` arrives, not at the end of the output.
    parser = HermesToolParser()
    first = hermes_call("get_time", {"tz": "CET"})
    assert parser.feed(first[:-1]) == ("", [])
    text, deltas = parser.feed(first[-1] + "\n<tool_c")
    assert text == "" and len(deltas) == 1 and parser.called
    d = deltas[0]
    assert (d.index, d.name, d.arguments) == (0, "get_time", '{"tz": "CET"}')
    assert CALL_ID.fullmatch(d.id)
    _, deltas = parser.feed('all>{"name": "get_weather", "arguments": {}}</tool_call>')
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(1, "get_weather", "{}")]
    assert parser.finish() == ("", [])


def test_plain_text_is_not_held():
    # Only a possible tag (or blank text, which may yet sit beside a call) waits.
    assert HermesToolParser().feed("Paris is") == ("Paris is", [])
    assert MistralToolParser().feed("Paris is") == ("Paris is", [])
    llama = Llama3JsonToolParser()
    assert llama.feed(" ") == ("", [])
    assert llama.feed("Paris") == (" Paris", [])
    assert llama.feed(" is") == (" is", [])
    hermes = HermesToolParser()
    assert hermes.feed("\n\n") == ("", [])
    assert hermes.feed("Hi <tool") == ("\n\nHi ", [])
    assert hermes.finish() == ("<tool", [])


def test_called_is_false_for_plain_text():
    for cls in TOOL_PARSERS.values():
        parser = cls()
        parser.feed("just text")
        parser.finish()
        assert not parser.called


def test_long_call_streams_in_linear_time():
    # 200k characters of arguments in 3-character deltas: a quadratic rescan would take minutes.
    args = {"text": "x" * 200_000}
    text = hermes_call("write", args)
    parser = HermesToolParser()
    t0 = time.perf_counter()
    deltas = []
    for i in range(0, len(text), 3):
        deltas += parser.feed(text[i : i + 3])[1]
    assert time.perf_counter() - t0 < 2.0
    assert len(deltas) == 1 and json.loads(deltas[0].arguments) == args


def test_registry():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    assert tool_parser("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        tool_parser("qwen")


def test_parse_json_tool_calls():
    calls = parse_json_tool_calls(
        '[{"name": "get_weather", "parameters": {"city": "Zürich"}}, '
        '{"name": "get_time", "parameters": {}}]'
    )
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Zürich"}'),
        ("get_time", "{}"),
    ]
    assert all(CALL_ID.fullmatch(c.id) for c in calls) and calls[0].id != calls[1].id
    one = parse_json_tool_calls('{"name": "f", "arguments": {"a": [1]}}')
    assert [(c.name, c.arguments) for c in one] == [("f", '{"a": [1]}')]
    assert parse_json_tool_calls("[]") == []
    with pytest.raises(ToolCallParseError, match="not JSON"):
        parse_json_tool_calls('[{"name": "f", "parameters": {')  # cut short by max_tokens
    with pytest.raises(ToolCallParseError, match="tool call 1"):
        parse_json_tool_calls('[{"name": "f", "parameters": {}}, {"parameters": {}}]')
