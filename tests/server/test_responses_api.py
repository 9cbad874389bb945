"""OpenAI's Responses API (/v1/responses) with the official `openai` client: the text equals what
`LLM.chat` computes greedily for the same conversation, streamed or not; the stream is OpenAI's
event sequence, numbered; `previous_response_id` continues a kept conversation (without the
earlier instructions); a cut answer is `incomplete`; bad requests are 4xx in OpenAI's shape.

Every server request carries its own cache_salt, so neither side reuses the other's prefix-cache
entries and greedy decoding computes the same tokens on both (see test_matches_offline.py).
"""

from __future__ import annotations

import json
import uuid

import openai
import pytest
from test_bad_input import wait_until_idle

from compile_engine.runtime.sampling_params import SamplingParams
from compile_engine.runtime.server_responses import ResponseStore, StoredResponse

from server_harness import MODEL_NAME, assert_error

R = "/v1/responses"

STREAM_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
STREAM_END = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def salt() -> dict:
    return {"cache_salt": uuid.uuid4().hex}


def chat(server, llm, messages: list[dict], max_tokens: int):
    """LLM.chat's greedy output for `messages`, and the prompt's length (engine thread)."""

    def run():
        out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
        return out.outputs[0], len(out.prompt_token_ids)

    return server.in_engine_thread(run)


def create(client: openai.OpenAI, **fields):
    return client.responses.create(model=MODEL_NAME, temperature=0, extra_body=salt(), **fields)


def test_text_and_usage_equal_chat(server, client, smollm2_llm):
    question = "What is the capital of France?"
    system = "Answer in one short sentence."
    want, prompt_len = chat(
        server,
        smollm2_llm,
        [{"role": "system", "content": system}, {"role": "user", "content": question}],
        24,
    )
    r = create(client, input=question, instructions=system, max_output_tokens=24)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL_NAME
    assert r.output_text == want.text and "Paris" in r.output_text
    assert r.status == "completed" and r.incomplete_details is None and r.error is None
    [message] = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "completed"
    assert [part.type for part in message.content] == ["output_text"]
    assert r.instructions == system and r.max_output_tokens == 24 and r.store is True
    assert r.usage.input_tokens == prompt_len
    assert r.usage.output_tokens == len(want.token_ids)
    assert r.usage.total_tokens == prompt_len + len(want.token_ids)


def test_message_items_equal_chat(server, client, smollm2_llm):
    """Items in both forms, parts of both text kinds, every role."""
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi!"}]},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_earlier",
            "status": "completed",
            "content": [
                {"type": "output_text", "text": "Hello! How can I help?", "annotations": []}
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Name a colour."},
                {"type": "input_text", "text": "Just one word."},
            ],
        },
    ]
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Name a colour.\nJust one word."},
    ]
    want, prompt_len = chat(server, smollm2_llm, messages, 8)
    r = create(client, input=items, max_output_tokens=8)
    assert r.output_text == want.text and r.usage.input_tokens == prompt_len


def test_stream_is_openai_event_sequence_and_equals_create(client):
    fields = dict(input="What is the capital of Germany?", max_output_tokens=24)
    whole = create(client, **fields)
    assert whole.status == "completed"
    with client.responses.stream(
        model=MODEL_NAME, temperature=0, extra_body=salt(), **fields
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    assert kinds == STREAM_EVENTS + ["response.output_text.delta"] * len(deltas) + STREAM_END + [
        "response.completed"
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text == events[-4].text
    created = events[0].response
    assert created.status == "in_progress" and created.output == [] and created.usage is None
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:-2] if hasattr(e, "item_id"))
    assert events[-2].item.content[0].text == text and events[-2].item.status == "completed"
    assert final.id == created.id and final.output_text == text
    assert final.status == "completed" and final.usage.output_tokens == whole.usage.output_tokens


def test_raw_stream_events_are_named_and_numbered(http):
    """On the wire: `event:` names each `data:`, and the stream ends without [DONE]."""
    body = {"model": MODEL_NAME, "input": "Say hi.", "max_output_tokens": 3, "stream": True}
    with http.stream("POST", R, json=body | salt()) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        blocks = r.read().decode().strip().split("\n\n")
    for n, block in enumerate(blocks):
        name, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}" and payload["sequence_number"] == n
    last = json.loads(blocks[-1].split("\n")[1].removeprefix("data: "))
    ending = {"completed": "response.completed", "incomplete": "response.incomplete"}
    assert last["type"] == ending[last["response"]["status"]]


def test_previous_response_id_continues_without_earlier_instructions(server, client, smollm2_llm):
    first_question, second_question = "What is the capital of Italy?", "And of Spain?"
    r1 = create(client, input=first_question, instructions="Answer briefly.", max_output_tokens=16)
    r2 = create(client, input=second_question, previous_response_id=r1.id, max_output_tokens=16)
    messages = [
        {"role": "user", "content": first_question},
        {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": second_question},
    ]
    want, prompt_len = chat(server, smollm2_llm, messages, 16)
    assert r2.output_text == want.text and r2.usage.input_tokens == prompt_len
    assert r2.previous_response_id == r1.id
    # A third turn carries both earlier ones, streamed this time.
    third = "Which of the two is larger?"
    with client.responses.stream(
        model=MODEL_NAME,
        input=third,
        previous_response_id=r2.id,
        max_output_tokens=6,
        temperature=0,
        extra_body=salt(),
    ) as stream:
        r3 = next(e for e in stream if e.type in ("response.completed", "response.incomplete"))
    messages += [
        {"role": "assistant", "content": r2.output_text},
        {"role": "user", "content": third},
    ]
    want, prompt_len = chat(server, smollm2_llm, messages, 6)
    assert r3.response.output_text == want.text
    assert r3.response.usage.input_tokens == prompt_len
    # The streamed response is kept too.
    assert client.responses.retrieve(r3.response.id).output_text == want.text


def test_retrieve_delete_and_store_false(client):
    r = create(client, input="Say yes.", max_output_tokens=2)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as excinfo:
        create(client, input="Go on.", previous_response_id=r.id, max_output_tokens=2)
    assert excinfo.value.body["param"] == "previous_response_id"
    assert excinfo.value.body["code"] == "previous_response_not_found"
    unkept = create(client, input="Say no.", max_output_tokens=2, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_max_output_tokens_cut_is_incomplete(server, client, smollm2_llm):
    question = "Write a long poem about the sea."
    want, _ = chat(server, smollm2_llm, [{"role": "user", "content": question}], 5)
    r = create(client, input=question, max_output_tokens=5)
    assert r.output_text == want.text and r.usage.output_tokens == 5
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete"
    stream = client.responses.create(
        model=MODEL_NAME,
        input=question,
        max_output_tokens=5,
        temperature=0,
        stream=True,
        extra_body=salt(),
    )
    last = list(stream)[-1]
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output_text == want.text


def test_store_keeps_the_newest():
    store = ResponseStore(limit=2)
    for i in range(3):
        store.put(f"resp_{i}", StoredResponse({"id": f"resp_{i}"}, []))
    assert len(store) == 2 and store.get("resp_0") is None
    assert store.get("resp_1") is not None and store.get("resp_2") is not None
    assert store.delete("resp_1") and not store.delete("resp_1")
    with pytest.raises(ValueError):
        ResponseStore(limit=0)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"text": {"format": {"type": "json_object"}}}, "text"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"truncation": "auto"}, "truncation"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input"),
        ({"input": []}, "input"),
        ({"input": 5}, "input"),
        ({"input": None}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": "5"}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"store": "yes"}, "store"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ],
)
def test_bad_requests_are_400_naming_the_field(http, fields, param):
    body = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 2} | fields
    r = http.post(R, json=body)
    assert_error(r, 400, param)


def test_off_values_and_unknown_fields_are_accepted(http):
    body = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 2, "tools": []}
    body |= {"tool_choice": "none", "text": {"format": {"type": "text"}, "verbosity": "low"}}
    body |= {"reasoning": {"effort": None}, "include": [], "truncation": "disabled"}
    body |= {"some_future_field": 1, "metadata": {"run": "7"}}
    r = http.post(R, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == {"run": "7"}


def test_model_route_and_method_errors(http, client):
    assert_error(http.post(R, json={"model": "gpt-nope", "input": "Hi"}), 404, "model")
    assert_error(http.get(R + "/resp_missing"), 404, "response_id")
    assert_error(http.put(R, json={}), 405)
    too_long = assert_error(http.post(R, json={"input": "Hi", "max_output_tokens": 10**9}), 400)
    assert too_long["code"] == "context_length_exceeded"
    assert "max_output_tokens" in too_long["message"]
    assert_error(http.post(R, content=b"{", headers={"Content-Type": "application/json"}), 400)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL_NAME, input="Hi", tools=[{"type": "web_search"}])


def test_engine_failure_mid_stream_is_response_failed(server, http):
    engine = server.engine

    def broken_step():
        raise RuntimeError("secret internal detail")

    body = {"model": MODEL_NAME, "input": "Hello", "max_output_tokens": 3, "stream": True}
    engine.step = broken_step
    try:
        with http.stream("POST", R, json=body) as r:
            text = r.read().decode()
    finally:
        del engine.step
    last = json.loads(text.strip().split("\n\n")[-1].split("\n")[1].removeprefix("data: "))
    assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
    assert last["response"]["error"]["code"] == "server_error" and "secret" not in text
    ok = http.post(R, json=body | {"stream": False})
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 3


def test_stream_client_that_hangs_up_is_aborted(server, http):
    body = {"model": MODEL_NAME, "input": "Tell me a long story.", "max_output_tokens": 400}
    with http.stream("POST", R, json=body | {"stream": True}) as r:
        for line in r.iter_lines():
            if "response.output_text.delta" in line:
                break
    wait_until_idle(server)
