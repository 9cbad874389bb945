"""Structured output and tools through the official openai client against the shared SmolLM2
server (CPU, greedy): every answer is checked with jsonschema / re, not by eye. Requests that
can run together are sent together, so the engine batches them (the suite runs on 2 cores)."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from server_harness import MODEL_NAME, assert_error

ASK = [{"role": "user", "content": "Describe a person as JSON."}]

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 6},
                "minItems": 2,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "enum_and_bounds": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "age": {"type": "integer", "minimum": 18, "maximum": 30},
        },
        "required": ["color", "age"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 8}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def _literal(text: str) -> str:
    """A regex (Rust syntax) matching exactly `text`."""
    return "".join("\\" + c if c in r".^$*+?{}[]\|()" else "\\n" if c == "\n" else c for c in text)


def _together(calls):
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def test_json_schemas_are_followed(client):
    def ask(schema):
        return lambda: client.chat.completions.create(
            model=MODEL_NAME,
            messages=ASK,
            max_tokens=80,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": schema, "strict": True},
            },
        )

    answers = _together([ask(schema) for schema in SCHEMAS.values()])
    for schema, answer in zip(SCHEMAS.values(), answers, strict=True):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_sampled_n2_and_vllm_fields(client):
    """json_object, sampling with n=2 (a matcher per sibling), and vLLM's extras on both
    endpoints: structured_outputs and the older guided_* fields."""
    codes = r"[A-Z]{2}[0-9]{3}"
    calls = [
        lambda: client.chat.completions.create(
            model=MODEL_NAME,
            messages=ASK,
            max_tokens=60,
            n=2,
            temperature=1.0,
            seed=3,
            response_format={"type": "json_object"},
        ),
        lambda: client.completions.create(
            model=MODEL_NAME, prompt="A code:", max_tokens=10, extra_body={"guided_regex": codes}
        ),
        lambda: client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Is Paris in France?"}],
            max_tokens=10,
            extra_body={"structured_outputs": {"choice": ["yes", "no", "not sure"]}},
        ),
        lambda: client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Count."}],
            max_tokens=20,
            extra_body={"guided_grammar": 'start: "1" ("," NUM)~2\nNUM: /[0-9]/'},
        ),
    ]
    obj, code, choice, grammar = _together(calls)
    assert len(obj.choices) == 2
    for c in obj.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
        else:  # cut by max_tokens: still a valid prefix of an object
            assert c.message.content.startswith("{")
    assert re.fullmatch(codes, code.choices[0].text)
    assert choice.choices[0].message.content in ("yes", "no", "not sure")
    assert re.fullmatch(r"1(,[0-9]){2}", grammar.choices[0].message.content)


def _assembled(stream) -> tuple[list[dict], str | None]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    assert call["id"] is None, "an id comes once, on the call's first fragment"
                    call["id"] = d.id
                if d.function and d.function.name:
                    call["name"] = d.function.name
                if d.function and d.function.arguments:
                    call["arguments"] += d.function.arguments
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_forced_tool_calls_validate_and_stream_the_same(client, tool_choice):
    common = dict(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    whole, streamed = _together(
        [
            lambda: client.chat.completions.create(**common),
            lambda: _assembled(client.chat.completions.create(**common, stream=True)),
        ]
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert len(calls) == 1 and calls[0].id.startswith("call_")
    name = calls[0].function.name
    if isinstance(tool_choice, dict):
        assert name == "get_time"
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMA_OF[name])
    stream_calls, finish = streamed
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in stream_calls] == [
        (name, json.loads(calls[0].function.arguments))
    ]


def test_auto_tool_choice_parses_the_models_own_format(client):
    """tool_choice auto with the shared server's hermes parser: the model's output (forced here
    by a regex, as SmolLM2 knows no tool format) becomes a call, whole and streamed."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    common = dict(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "What time is it?"}],
        tools=[WEATHER, TIME],
        max_tokens=60,
        extra_body={"structured_outputs": {"regex": _literal(call)}},
    )
    whole, streamed = _together(
        [
            lambda: client.chat.completions.create(**common),
            lambda: _assembled(client.chat.completions.create(**common, stream=True)),
        ]
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (made,) = choice.message.tool_calls
    assert made.function.name == "get_time"
    assert json.loads(made.function.arguments) == {"zone": "UTC"}
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed[0]] == [
        ("get_time", {"zone": "UTC"})
    ]


def test_tool_turns_reach_the_template(client):
    """An assistant turn with tool_calls and the tool's answer are accepted and rendered."""
    messages = [
        {"role": "user", "content": "Time in UTC?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=[TIME], tool_choice="none", max_tokens=3
    )
    assert r.usage.completion_tokens >= 1 and not r.choices[0].message.tool_calls


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}},
         "response_format"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)  # fmt: skip
def test_bad_constraints_are_a_400_naming_the_field(http, body, param):
    r = http.post(
        "/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": ASK, "max_tokens": 2} | body,
    )
    assert_error(r, 400, param)


def test_a_slow_grammar_is_refused_and_nothing_waits_for_it(server, client, monkeypatch):
    """A compile past the time limit is a 400, and while it is still compiling another request
    is answered: the compile runs on the grammar threads, not the engine's or the event loop."""
    from compile_engine.runtime import structured_output

    compiler = server.engine.structured.compiler
    release, compiling = threading.Event(), threading.Event()

    def slow_grammar_text(spec):
        compiling.set()
        release.wait(30)
        compiling.clear()
        return grammar_text(spec)

    grammar_text = structured_output.grammar_text
    monkeypatch.setattr(structured_output, "grammar_text", slow_grammar_text)
    monkeypatch.setattr(compiler, "timeout_s", 0.2)
    try:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=MODEL_NAME, messages=ASK, max_tokens=5, extra_body={"guided_regex": "q{2,9}"}
            )
        assert "longer than 0.2 s" in info.value.body["message"]
        assert compiling.is_set()
        r = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=2)
        assert r.usage.completion_tokens >= 1
        assert compiling.is_set()  # answered while the grammar thread was still busy
    finally:
        release.set()
