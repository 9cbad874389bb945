"""Bad or unusual client input, as vLLM/SGLang users send it with the `openai` client or raw HTTP:
each gets a 4xx in OpenAI's error shape that says what to do, and costs nobody else anything
(the server keeps serving, other requests in flight finish, a dropped client frees its blocks).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from aiohttp import web

from compile_engine.runtime.protocol import MAX_STOP, MAX_STOP_TOKEN_IDS
from compile_engine.runtime.server import ASYNC_LLM

from server_harness import API_KEY, MODEL_NAME, assert_error

HI = [{"role": "user", "content": "Hi"}]
C, CHAT = "/v1/completions", "/v1/chat/completions"


def post(http: httpx.Client, path: str, body: dict | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(path, content=content, headers={"Content-Type": "application/json"})


def wait_until_idle(server, timeout: float = 5.0) -> None:
    """The engine holds no request and no KV block (polled: aborts land a step later)."""
    llm = server.app[ASYNC_LLM]

    def busy() -> tuple:
        stats = llm.stats  # snapshot from the engine thread, as /metrics reads it
        return llm.num_in_flight, stats.num_running, stats.num_waiting, stats.kv_cache_usage

    deadline = time.monotonic() + timeout
    while any(busy()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(busy()), f"(in flight, running, waiting, kv usage) = {busy()}"


# -- fields of the wrong type or range ----------------------------------------------------------


@pytest.mark.parametrize(
    "path, field, value",
    [
        (C, "max_tokens", "5"),  # a string is not coerced to a number...
        (C, "max_tokens", True),  # ...nor a boolean (true would mean max_tokens=1)
        (C, "max_tokens", 2.5),
        (C, "n", "2"),
        (C, "temperature", True),
        (C, "logprobs", True),
        (C, "echo", "yes"),
        (CHAT, "stream", "yes"),  # "yes" would turn a JSON answer into an event stream
        (CHAT, "logprobs", "true"),
        (CHAT, "top_logprobs", 1.5),
    ],
)
def test_wrong_types_are_400_not_coerced(http, path, field, value):
    body = {"prompt": "x"} if path == C else {"messages": HI, "logprobs": True}
    body |= {"max_tokens": 2, field: value}
    assert_error(post(http, path, body), 400, field)


@pytest.mark.parametrize(
    "path, body, param",
    [
        (C, {"max_tokens": 2}, "prompt"),
        (CHAT, {"max_tokens": 2}, "messages"),
        (CHAT, {"messages": [], "max_tokens": 2}, "messages"),
        (C, {"prompt": "x", "n": 0}, "n"),
        (C, {"prompt": "x", "n": 1000}, "n"),
        (C, {"prompt": "x", "top_p": 0}, "top_p"),
        (C, {"prompt": "x", "top_p": 1.5}, "top_p"),
        (C, {"prompt": "x", "logprobs": 21}, "logprobs"),
        (CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (CHAT, {"messages": HI, "top_logprobs": 2}, "top_logprobs"),
        (C, {"prompt": "x", "stop": ""}, "stop"),
        (C, {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
        (
            C,
            {"prompt": "x", "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))},
            "stop_token_ids",
        ),
        (CHAT, {"messages": HI, "max_completion_tokens": 0}, "max_tokens"),
        (CHAT, {"messages": HI, "stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_out_of_range_and_missing_fields_are_400(http, path, body, param):
    assert_error(post(http, path, body), 400, param)


def test_negative_temperature_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, temperature=-1)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL_NAME, messages=HI, max_tokens=2, temperature=-0.5
        )


def test_unpaired_surrogate_escape_is_400_not_500(http):
    """JSON may escape a lone UTF-16 surrogate ("\\ud800"); Python decodes it to a str that no
    tokenizer takes. A surrogate pair (an escaped emoji) is fine."""
    prompt = b'{"prompt": "Hi \\ud800 there", "max_tokens": 2, "stream": %s}'
    for stream in (b"false", b"true"):
        error = assert_error(post(http, C, prompt % stream), 400, "prompt")
        assert "surrogate" in error["message"]
    chat = b'{"messages": [{"role": "user", "content": "Hi \\udc00"}], "max_tokens": 2}'
    assert_error(post(http, CHAT, chat), 400, "messages")
    assert_error(post(http, "/tokenize", b'{"prompt": "\\ud800"}'), 400, "prompt")
    pair = post(http, C, b'{"prompt": "Hi \\ud83d\\ude00", "max_tokens": 2}')
    assert pair.status_code == 200, pair.text


def test_empty_prompt_is_invalid_value_not_context_length(http):
    """A client that handles context_length_exceeded by shortening the prompt must not see it
    for an empty one."""
    for prompt in ("", [], ["Hello", ""], [[1, 2], []]):
        error = assert_error(post(http, C, {"prompt": prompt, "max_tokens": 2}), 400, "prompt")
        assert error["code"] == "invalid_value"


def test_stop_as_string_or_list_and_too_many(client):
    kwargs = dict(model=MODEL_NAME, prompt="Count: 1, 2, 3,", max_tokens=8, temperature=0)
    text = client.completions.create(**kwargs).choices[0].text
    stop = text.strip()[:1]
    assert stop, text
    as_str = client.completions.create(stop=stop, **kwargs).choices[0]
    as_list = client.completions.create(stop=[stop, "never-generated"], **kwargs).choices[0]
    assert as_str.finish_reason == as_list.finish_reason == "stop"
    assert as_str.text == as_list.text and stop not in as_str.text
    # Every stop string is searched for after every token, in the engine's one thread: an
    # unbounded list from one client would slow every request on the server.
    stops = [f"stop-{i}" for i in range(MAX_STOP + 1)]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(stop=stops, **kwargs)
    assert info.value.body["param"] == "stop" and str(MAX_STOP) in info.value.body["message"]
    ok = client.completions.create(stop=stops[:MAX_STOP], **(kwargs | {"max_tokens": 2})).choices
    assert ok[0].finish_reason == "length" and ok[0].text and text.startswith(ok[0].text)


def test_completions_stream_include_usage_over_a_batch(client):
    """Two prompts × n=2 in one stream: four choices, then one usage chunk for all of them."""
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=["Hello", "The sky is"],
            n=2,
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 4 * 3
    assert all(c.usage is None and len(c.choices) == 1 for c in body)
    assert {c.choices[0].index for c in body} == {0, 1, 2, 3}
    finished = [c.choices[0].index for c in body if c.choices[0].finish_reason == "length"]
    assert sorted(finished) == [0, 1, 2, 3]


# -- chat messages ------------------------------------------------------------------------------


def test_text_content_parts_are_accepted(client, http):
    parts = [
        {"type": "text", "text": "Answer in one word."},
        {"type": "text", "text": "What is the capital of France?"},
    ]
    kwargs = dict(model=MODEL_NAME, max_tokens=8, temperature=0)
    as_parts = client.chat.completions.create(
        messages=[{"role": "user", "content": parts}], **kwargs
    )
    # The parts joined by a newline, as vLLM joins them: the same prompt as that string.
    joined = [{"role": "user", "content": "Answer in one word.\nWhat is the capital of France?"}]
    as_string = client.chat.completions.create(messages=joined, **kwargs)
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content
    assert as_parts.choices[0].message.content
    tokens = [
        post(http, "/tokenize", {"messages": m}).json()["tokens"]
        for m in ([{"role": "user", "content": parts}], joined)
    ]
    assert tokens[0] == tokens[1]


def test_image_and_audio_parts_are_a_clear_400(client):
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    for part in (image, audio):
        content = [{"type": "text", "text": "What is this?"}, part]
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": content}], max_tokens=2
            )
        body = info.value.body
        assert body["param"] == "messages"
        assert part["type"] in body["message"] and "text" in body["message"]
        assert "more problem" not in body["message"]  # one clear reason, not a union dump


@pytest.mark.parametrize(
    "message, says",
    [
        ({"role": "wizard", "content": "hi"}, "role"),
        ({"content": "hi"}, "role"),
        ({"role": "user"}, "content"),
        ({"role": "user", "content": 5}, "content"),
        ({"role": "user", "content": [{"type": "text"}]}, "text"),
        (
            {
                "role": "user",
                "content": "hi",
                "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            "tool_calls",
        ),
    ],
)
def test_bad_messages_are_400(http, message, says):
    for path in (CHAT, "/tokenize"):
        error = assert_error(post(http, path, {"messages": [message], "max_tokens": 2}), 400)
        assert error["param"] == "messages" and says in error["message"], error
        assert "more problem" not in error["message"]


def test_known_roles_are_accepted(client):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)
    assert r.usage.completion_tokens >= 1


# -- parameters this server does not implement --------------------------------------------------

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "field, value",
    [
        ("functions", [{"name": "f", "parameters": {}}]),
        ("function_call", {"name": "f"}),
        ("logits_processors", ["my.module:Processor"]),
        ("allowed_token_ids", [1, 2]),
        ("continue_final_message", True),
        ("chat_template", "{{ messages }}"),
        ("modalities", ["text", "audio"]),
        ("use_beam_search", True),
    ],
)
def test_unsupported_parameters_are_refused_by_name(client, field, value):
    """Ignoring these would change what the answer means (a tool call or JSON the client relies
    on, a different prompt), so they are a 400 naming the field, not silently dropped. (Tools
    and structured output are served: tests/server/test_structured_output.py.)"""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL_NAME, messages=HI, max_tokens=2, extra_body={field: value}
        )
    body = info.value.body
    assert body["param"] == field and body["code"] == "unsupported"
    assert field in body["message"]


def test_unsupported_parameters_on_completions(client):
    for field, value in [
        ("use_beam_search", True),
        ("bad_words", ["x"]),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(
                model=MODEL_NAME, prompt="x", max_tokens=2, extra_body={field: value}
            )
        assert info.value.body["param"] == field


def test_parameters_at_their_off_value_are_accepted(client):
    """What clients send by default (or to say "off") is no reason to refuse."""
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=HI,
        max_tokens=2,
        response_format={"type": "text"},
        tool_choice="none",
        parallel_tool_calls=False,
        extra_body={"tools": [], "chat_template_kwargs": {}, "continue_final_message": False},
    )
    assert r.usage.completion_tokens >= 1


def test_chat_template_kwargs_reach_the_template(server, client, http):
    """vLLM's chat_template_kwargs: template variables (Qwen3 clients send enable_thinking);
    apply_chat_template's own arguments are refused by name."""
    import copy

    from compile_engine.runtime.server_openai import chat_prompt

    # Copied on the engine thread; the test thread alone uses the copy.
    tokenizer = server.in_engine_thread(lambda: copy.deepcopy(server.engine.tokenizer))
    tokenizer.chat_template = "{% if shout %}LOUD {% endif %}{{ messages[0]['content'] }}"
    quiet = chat_prompt(tokenizer, HI, False)
    loud = chat_prompt(tokenizer, HI, False, {"shout": True})
    assert tokenizer.decode(loud) == "LOUD Hi" and tokenizer.decode(quiet) == "Hi"
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=HI, max_tokens=2,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    assert r.usage.completion_tokens >= 1
    for path, body in [
        (CHAT, {"messages": HI, "max_tokens": 2}),
        ("/tokenize", {"messages": HI}),
    ]:
        bad = body | {"chat_template_kwargs": {"tokenize": False}}
        error = assert_error(post(http, path, bad), 400, "chat_template_kwargs")
        assert "tokenize" in error["message"]


# -- models and health --------------------------------------------------------------------------


def test_models_retrieve_and_health(client, http):
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert info.value.body["code"] == "model_not_found"
    assert http.get("/health").status_code == 200
    # /health needs no key, /v1/models does.
    assert httpx.get(http.base_url.join("/health")).status_code == 200
    assert_error(httpx.get(http.base_url.join("/v1/models")), 401)


# -- one bad request costs nobody else ----------------------------------------------------------


def test_malformed_requests_among_concurrent_ones(server):
    """Good requests (one of them streaming) run while malformed ones arrive; every good one
    finishes in full and every bad one gets its own 4xx."""

    async def good(client: openai.AsyncOpenAI, i: int) -> int:
        r = await client.completions.create(
            model=MODEL_NAME,
            prompt=f"Story number {i}:",
            max_tokens=6,
            extra_body={"ignore_eos": True},
        )
        return r.usage.completion_tokens

    async def streamed(client: openai.AsyncOpenAI) -> tuple[int, str | None]:
        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=HI,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        return chunks[-1].usage.completion_tokens, finish

    async def bad(client: openai.AsyncOpenAI, kind: int) -> type[Exception]:
        calls = [
            lambda: client.completions.create(
                model=MODEL_NAME, prompt="x", max_tokens=2, temperature=-1
            ),
            lambda: client.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            ),
            lambda: client.completions.create(model="nope", prompt="x", max_tokens=2),
            lambda: client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=10**6),
            lambda: client.chat.completions.create(
                model=MODEL_NAME,
                messages=HI,
                max_tokens=2,
                tools=[TOOL],
                tool_choice={"type": "function", "function": {"name": "missing"}},
            ),
        ]
        try:
            await calls[kind]()
        except openai.APIStatusError as exc:
            return type(exc)
        raise AssertionError(f"bad request {kind} was accepted")

    async def main():
        async with openai.AsyncOpenAI(
            base_url=server.api_url, api_key=API_KEY, timeout=120, max_retries=0
        ) as client:
            tasks = [good(client, i) for i in range(6)] + [streamed(client)]
            tasks += [bad(client, k) for k in range(5)]
            return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    assert results[:6] == [6] * 6
    assert results[6] == (8, "length")
    assert results[7:] == [
        openai.BadRequestError,
        openai.BadRequestError,
        openai.NotFoundError,
        openai.BadRequestError,
        openai.BadRequestError,
    ]


# -- clients that go away -----------------------------------------------------------------------


def test_batched_stream_disconnect_frees_every_sequence(server, http):
    """Two prompts × n=2 are four engine sequences in one stream: hanging up aborts them all."""
    body = {"prompt": ["Tell me a story.", "Once upon a time"], "n": 2, "max_tokens": 300}
    body |= {"ignore_eos": True, "stream": True}
    with http.stream("POST", C, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    wait_until_idle(server)


def test_stream_whose_headers_cannot_be_sent_is_aborted(server, http, monkeypatch):
    """The client hangs up after its request is queued but before the stream's headers go out:
    the request must still be aborted, not run to max_tokens for nobody."""
    real_prepare = web.StreamResponse.prepare

    async def prepare(self, request):
        if type(self) is not web.StreamResponse:  # JSON answers are not streams
            return await real_prepare(self, request)
        if request.transport is not None:
            request.transport.close()
        raise ConnectionResetError("Cannot write to closing transport")

    monkeypatch.setattr(web.StreamResponse, "prepare", prepare)
    body = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.TransportError):
        post(http, C, body | {"stream": True})
    monkeypatch.undo()
    # 400 tokens take far longer than this on CPU: only an abort empties the engine this fast.
    wait_until_idle(server)
    assert post(http, C, {"prompt": "Hi", "max_tokens": 2}).status_code == 200
