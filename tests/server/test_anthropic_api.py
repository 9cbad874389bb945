"""Anthropic's Messages API (/v1/messages) with the official `anthropic` client: the text equals
what `LLM.chat` computes greedily for the same conversation (system prompt first), streamed or
not; the stream is Anthropic's event sequence; stop sequences, max_tokens and the end of turn
each give their stop_reason; count_tokens counts the prompt; the API key comes as x-api-key or
Bearer; bad requests are 4xx in Anthropic's error shape.

This anthropic client has no sampling arguments (temperature, top_p, top_k), which Anthropic's
newer models ignore; greedy decoding is asked for with extra_body, as any extra field. Every
request carries its own cache_salt (test_matches_offline.py says why).
"""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import pytest
from test_bad_input import wait_until_idle

from compile_engine.runtime.sampling_params import SamplingParams

from server_harness import API_KEY, MODEL_NAME

M = "/v1/messages"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    """The official anthropic client on the shared server; it sends the key as x-api-key."""
    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, timeout=60, max_retries=0)


def greedy() -> dict:
    return {"temperature": 0, "cache_salt": uuid.uuid4().hex}


def chat(server, llm, messages: list[dict], max_tokens: int, stop: list[str] | None = None):
    """LLM.chat's greedy output for `messages`, and the prompt's length (engine thread)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=stop or [])

    def run():
        out = llm.chat(messages, params)[0]
        return out.outputs[0], len(out.prompt_token_ids)

    return server.in_engine_thread(run)


def create(claude: anthropic.Anthropic, **fields):
    return claude.messages.create(model=MODEL_NAME, extra_body=greedy(), **fields)


def anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    """The response is an error of `status` in Anthropic's shape; returns its message."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind
    assert body["error"]["message"] and "Traceback" not in body["error"]["message"]
    return body["error"]["message"]


def test_text_and_usage_equal_chat_with_system(server, claude, smollm2_llm):
    system = "You are terse."
    messages = [{"role": "system", "content": system}] + FRANCE
    want, prompt_len = chat(server, smollm2_llm, messages, 24)
    assert want.finish_reason == "stop"  # the answer ends within the budget
    m = create(claude, max_tokens=24, system=system, messages=FRANCE)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == MODEL_NAME
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want.text
    assert "Paris" in want.text
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.usage.input_tokens == prompt_len and m.usage.output_tokens == len(want.token_ids)


def test_blocks_equal_strings(server, claude, smollm2_llm):
    """System and content as text blocks (joined by newlines), and a multi-turn conversation."""
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Hi!"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello! How can I help?"}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Name a colour."},
                {"type": "text", "text": "One word.", "cache_control": {"type": "ephemeral"}},
            ],
        },
    ]
    system = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}]
    flat = [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Name a colour.\nOne word."},
    ]
    want, prompt_len = chat(server, smollm2_llm, flat, 8)
    m = create(claude, max_tokens=8, system=system, messages=messages)
    assert m.content[0].text == want.text and m.usage.input_tokens == prompt_len


def test_stream_is_anthropic_event_sequence_and_equals_create(claude):
    fields = dict(max_tokens=24, messages=FRANCE)
    whole = create(claude, **fields)
    raw = list(claude.messages.create(model=MODEL_NAME, stream=True, extra_body=greedy(), **fields))
    kinds = [e.type for e in raw]
    deltas = [e for e in raw if e.type == "content_block_delta"]
    assert len(deltas) > 1
    assert kinds == ["message_start", "content_block_start"] + ["content_block_delta"] * len(
        deltas
    ) + ["content_block_stop", "message_delta", "message_stop"]
    start = raw[0].message
    assert start.content == [] and start.stop_reason is None
    assert start.usage.input_tokens == whole.usage.input_tokens
    assert raw[1].index == 0 and raw[1].content_block.type == "text"
    assert all(d.index == 0 and d.delta.type == "text_delta" for d in deltas)
    assert "".join(d.delta.text for d in deltas) == whole.content[0].text
    assert raw[-2].delta.stop_reason == whole.stop_reason == "end_turn"
    assert raw[-2].usage.output_tokens == whole.usage.output_tokens

    with claude.messages.stream(model=MODEL_NAME, extra_body=greedy(), **fields) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text
    assert final.content[0].text == text and final.stop_reason == "end_turn"
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_raw_stream_names_every_event_and_pings(http):
    """On the wire: `event:` names each `data:` (the client skips unnamed ones), with a ping."""
    body = {"model": MODEL_NAME, "max_tokens": 3, "messages": FRANCE, "stream": True}
    with http.stream("POST", M, json=body | greedy()) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        blocks = r.read().decode().strip().split("\n\n")
    names = []
    for block in blocks:
        name, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        names.append(payload["type"])
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_sequences(server, claude, smollm2_llm):
    want, _ = chat(server, smollm2_llm, FRANCE, 24, stop=[" Paris"])
    assert want.finish_reason == "stop" and want.stop_reason == " Paris"
    fields = dict(max_tokens=24, messages=FRANCE, stop_sequences=["Berlin", " Paris"])
    m = create(claude, **fields)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == " Paris"
    assert m.content[0].text == want.text and "Paris" not in want.text
    with claude.messages.stream(model=MODEL_NAME, extra_body=greedy(), **fields) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == want.text
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == " Paris"


def test_max_tokens_cut(server, claude, smollm2_llm):
    messages = [{"role": "user", "content": "Write a long poem about the sea."}]
    want, _ = chat(server, smollm2_llm, messages, 4)
    m = create(claude, max_tokens=4, messages=messages)
    assert m.content[0].text == want.text
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 4
    with claude.messages.stream(
        model=MODEL_NAME, max_tokens=4, messages=messages, extra_body=greedy()
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens" and final.content[0].text == want.text


def test_count_tokens_counts_the_prompt(server, claude, smollm2_llm):
    system = "Be brief."
    ids = server.in_engine_thread(
        lambda: smollm2_llm.apply_chat_template([{"role": "system", "content": system}] + FRANCE)
    )
    count = claude.messages.count_tokens(model=MODEL_NAME, system=system, messages=FRANCE)
    assert count.input_tokens == len(ids)


def test_api_key_as_x_api_key_or_bearer(server):
    def client(**auth) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=server.base_url, max_retries=0, timeout=60, **auth)

    fields = dict(model=MODEL_NAME, max_tokens=1, messages=FRANCE)
    assert client(api_key=API_KEY).messages.create(**fields).usage.output_tokens == 1
    assert client(auth_token=API_KEY).messages.create(**fields).usage.output_tokens == 1
    with pytest.raises(anthropic.AuthenticationError):
        client(api_key="wrong").messages.create(**fields)
    # x-api-key is Anthropic's header: the OpenAI routes still want Bearer.
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"messages": FRANCE, "max_tokens": 1},
        headers={"x-api-key": API_KEY},
    )
    assert r.status_code == 401


HI = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    "fields, status, kind, names",
    [
        ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
        ({"max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
        ({"max_tokens": "5"}, 400, "invalid_request_error", "max_tokens"),
        ({"model": None}, 400, "invalid_request_error", "model"),
        ({"model": "claude-nope"}, 404, "not_found_error", "claude-nope"),
        ({"messages": []}, 400, "invalid_request_error", "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error", "role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            400,
            "invalid_request_error",
            "image",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
            400,
            "invalid_request_error",
            "tool_result",
        ),
        (
            {"messages": HI + [{"role": "assistant", "content": "Hel"}]},
            400,
            "invalid_request_error",
            "prefill",
        ),
        ({"system": [{"type": "image"}]}, 400, "invalid_request_error", "system"),
        ({"tools": [{"name": "f", "input_schema": {}}]}, 400, "invalid_request_error", "tools"),
        ({"tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tool_choice"),
        (
            {"thinking": {"type": "enabled", "budget_tokens": 1024}},
            400,
            "invalid_request_error",
            "thinking",
        ),
        ({"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
        ({"top_p": 0}, 400, "invalid_request_error", "top_p"),
        ({"top_k": -1}, 400, "invalid_request_error", "top_k"),
        ({"stop_sequences": [""]}, 400, "invalid_request_error", "stop"),
        ({"stop_sequences": "END"}, 400, "invalid_request_error", "stop_sequences"),
        ({"stream": "yes"}, 400, "invalid_request_error", "stream"),
        ({"max_tokens": 10**9}, 400, "invalid_request_error", "max_model_len"),
    ],
)
def test_bad_requests_have_anthropic_shape(http, fields, status, kind, names):
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": HI} | fields
    body = {k: v for k, v in body.items() if v is not None}
    message = anthropic_error(http.post(M, json=body), status, kind)
    assert names in message


def test_client_raises_typed_errors(claude):
    with pytest.raises(anthropic.BadRequestError) as excinfo:
        claude.messages.create(
            model=MODEL_NAME, max_tokens=2, messages=HI, tools=[{"name": "f", "input_schema": {}}]
        )
    assert excinfo.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-nope", max_tokens=2, messages=HI)


def test_not_json_and_count_tokens_errors(http):
    r = http.post(M, content=b"{", headers={"Content-Type": "application/json"})
    anthropic_error(r, 400, "invalid_request_error")
    r = http.post(M + "/count_tokens", json={"model": MODEL_NAME, "messages": []})
    anthropic_error(r, 400, "invalid_request_error")


def test_engine_failure_mid_stream_is_an_error_event(server, claude, http):
    engine = server.engine

    def broken_step():
        raise RuntimeError("secret internal detail")

    engine.step = broken_step
    try:
        stream = claude.messages.stream(model=MODEL_NAME, max_tokens=3, messages=HI)
        with pytest.raises(anthropic.APIStatusError) as excinfo, stream as events:
            events.get_final_message()
        failed = http.post(M, json={"model": MODEL_NAME, "max_tokens": 3, "messages": HI})
    finally:
        del engine.step
    assert excinfo.value.body["error"]["type"] == "api_error"
    assert "secret" not in str(excinfo.value.body)
    anthropic_error(failed, 500, "api_error")
    assert create(claude, max_tokens=3, messages=HI).usage.output_tokens >= 1


def test_stream_client_that_hangs_up_is_aborted(server, http):
    body = {"model": MODEL_NAME, "max_tokens": 400, "stream": True}
    body["messages"] = [{"role": "user", "content": "Tell me a long story."}]
    with http.stream("POST", M, json=body) as r:
        for line in r.iter_lines():
            if "content_block_delta" in line:
                break
    wait_until_idle(server)
