"""The OpenAI-compatible server on loopback, driven by the official `openai` client (issue 6)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import openai
import pytest

from compile_engine.runtime.sampling_params import SamplingParams

from server_harness import API_KEY, MAX_BODY_BYTES, MODEL_NAME, assert_error

PARIS = [{"role": "user", "content": "What is the capital of France?"}]


def metric(http: httpx.Client, name: str) -> float:
    text = http.get("/metrics").text
    match = re.search(rf"^compile_engine:{name}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


# -- the happy paths ----------------------------------------------------------------------------


def test_models_and_health(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert http.get("/health").status_code == 200


def test_completion(server, client, smollm2_llm):
    prompt = "The quick brown fox"
    params = SamplingParams(temperature=0.0, max_tokens=6)
    want = server.in_engine_thread(lambda: smollm2_llm.generate(prompt, params)[0])
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0)
    choice = r.choices[0]
    assert r.object == "text_completion" and choice.text == want.outputs[0].text
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)


def test_chat_names_paris(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=PARIS, temperature=0, max_tokens=20
    )
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"


def test_streaming_equals_non_streaming_with_usage_last(client):
    kwargs = dict(model=MODEL_NAME, temperature=0, max_tokens=12)
    full = client.chat.completions.create(messages=PARIS, **kwargs)
    chunks = list(
        client.chat.completions.create(
            messages=PARIS, stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == full.choices[0].finish_reason

    prompt = "Once upon a time"
    full = client.completions.create(prompt=prompt, **kwargs)
    chunks = list(client.completions.create(prompt=prompt, stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text


def test_n2_and_seed(server, client, smollm2_llm):
    kwargs = dict(model=MODEL_NAME, prompt="My favourite colour is", max_tokens=8)
    r = client.completions.create(n=2, temperature=1.0, seed=7, **kwargs)
    assert sorted(c.index for c in r.choices) == [0, 1]
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=8)
    want = server.in_engine_thread(lambda: smollm2_llm.generate(kwargs["prompt"], params)[0])
    assert [c.text for c in r.choices] == [c.text for c in want.outputs]
    assert 2 <= r.usage.completion_tokens <= 16  # both choices count
    again = client.completions.create(n=2, temperature=1.0, seed=7, **kwargs)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    one = client.completions.create(temperature=1.0, seed=123, **kwargs)
    assert client.completions.create(temperature=1.0, seed=123, **kwargs).choices[0].text == (
        one.choices[0].text
    )


def test_chat_logprobs_top3(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=PARIS, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode() == entry.token
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_completion_logprobs_and_echo(client):
    prompt = "The capital of France is"
    r = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True
    )
    choice = r.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    # Every token is scored (the prompt's too, as vLLM's echo does) but the first.
    scored = [x for x in lp.token_logprobs if x is not None]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(scored) == len(lp.tokens) - 1 and all(x <= 0 for x in scored)
    assert "".join(lp.tokens) == choice.text
    assert all(len(top) >= 2 for top in lp.top_logprobs if top is not None)


def test_stop_strings(client):
    kwargs = dict(model=MODEL_NAME, prompt="List the days of the week:", temperature=0)
    text = client.completions.create(max_tokens=16, **kwargs).choices[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    r = client.completions.create(max_tokens=16, stop=[stop], **kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and stop not in choice.text
    assert text.startswith(choice.text)


def test_tokenize_detokenize(http):
    tokens = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "Hello world"
    chat = http.post("/tokenize", json={"messages": PARIS}).json()
    assert chat["count"] > tokens["count"]
    assert_error(http.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")


def test_tokenizer_work_runs_on_the_pool_each_copy_on_one_thread(server, client, http, monkeypatch):
    """A request's tokenizer work (prompts, templates, echo text, /tokenize, /detokenize) runs on
    the tokenizer pool's threads, each using only its own copy (a fast tokenizer must not be used
    from two threads at once); the engine gets token ids, so its own tokenizer only decodes, for
    its detokenizer, on the engine thread; the event loop uses none (issue 31)."""
    from compile_engine.runtime.server_common import STATE

    pool = server.app[STATE].tokenizers
    engine_thread = server.in_engine_thread(threading.get_ident)
    owners = {"engine": server.engine.tokenizer}
    owners |= {f"copy {i}": t for i, t in enumerate(pool.tokenizers)}
    assert len({id(t) for t in owners.values()}) == len(owners)
    calls: list[tuple[str, str, int, str]] = []

    def spy(owner: str, name: str):
        real = getattr(owners[owner], name)

        def call(*args, **kwargs):
            thread = threading.current_thread()
            calls.append((owner, name, thread.ident, thread.name))
            return real(*args, **kwargs)

        return call

    for owner, tokenizer in owners.items():
        for name in ("encode", "decode", "batch_decode", "apply_chat_template"):
            monkeypatch.setattr(tokenizer, name, spy(owner, name))
    kwargs = dict(model=MODEL_NAME, max_tokens=3, temperature=0, logprobs=2, echo=True)
    for prompt, stream in [("Spy on me", False), ([504, 3209], False), ([504, 3209], True)]:
        list(client.completions.create(prompt=prompt, stream=stream, **kwargs))
    chat = dict(model=MODEL_NAME, messages=PARIS, max_tokens=3, logprobs=True, top_logprobs=2)
    for stream in (False, True):
        list(client.chat.completions.create(stream=stream, **chat))
    http.post("/tokenize", json={"prompt": "Hello"}).raise_for_status()
    http.post("/tokenize", json={"messages": PARIS}).raise_for_status()
    http.post("/detokenize", json={"tokens": [504, 3209]}).raise_for_status()
    monkeypatch.undo()
    engine_calls = [c for c in calls if c[0] == "engine"]
    pool_calls = [c for c in calls if c[0] != "engine"]
    assert {name for _, name, _, _ in engine_calls} == {"decode"}
    assert {thread for _, _, thread, _ in engine_calls} == {engine_thread}
    assert {"encode", "decode", "apply_chat_template"} <= {name for _, name, _, _ in pool_calls}
    assert all(name.startswith("tokenizer") for _, _, _, name in pool_calls)
    threads_of: dict[str, set[int]] = {}
    for owner, _, thread, _ in pool_calls:
        threads_of.setdefault(owner, set()).add(thread)
    assert all(len(threads) == 1 for threads in threads_of.values()), threads_of


def test_metrics_names(http):
    text = http.get("/metrics").text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_preemptions_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_count",
    ):
        assert f"compile_engine:{name}" in text, name
    assert metric(http, "generation_tokens_total") > 0


def test_step_counters_count_what_a_request_computes(client, http):
    """Our engine_* counters: a request of P prompt tokens (none cached) that generates N
    computes P + N - 1 tokens (its last sampled token is never fed back), in at least N steps;
    on the CPU no step replays a CUDA graph and none waits for a device."""
    names = ["engine_steps_total", "engine_step_tokens_total", "engine_graph_steps_total"]
    names += ["engine_busy_seconds_total", "engine_device_wait_seconds_total"]
    before = {name: metric(http, name) for name in names}
    prompt = list(range(1000, 1037))  # 37 token ids that no other test sends
    r = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == 7 and r.usage.prompt_tokens == 37
    delta = {name: metric(http, name) - before[name] for name in names}
    assert delta["engine_step_tokens_total"] == 37 + 7 - 1
    assert delta["engine_steps_total"] >= 7
    assert delta["engine_graph_steps_total"] == 0
    assert delta["engine_device_wait_seconds_total"] == 0
    assert delta["engine_busy_seconds_total"] > 0


# -- errors ---------------------------------------------------------------------------------------


def test_errors_have_the_openai_shape_and_the_server_keeps_serving(server, client, http):
    def post(body: bytes | dict, path: str = "/v1/completions", **kw) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return http.post(path, content=content, headers={"Content-Type": "application/json"}, **kw)

    assert_error(post(b'{"prompt": "x", '), 400)
    assert_error(post(b"[1, 2]"), 400)
    assert_error(post({"prompt": "x", "max_tokens": -3}), 400, "max_tokens")
    assert_error(post({"prompt": "x", "temperature": "hot"}), 400, "temperature")
    assert_error(post({"messages": "hi"}, "/v1/chat/completions"), 400, "messages")
    assert_error(post({"prompt": "x", "model": "gpt-4"}), 404, "model")
    too_long = "word " * (server.engine.max_model_len + 10)
    error = assert_error(post({"prompt": too_long, "max_tokens": 4}), 400)
    assert "max_model_len" in error["message"]
    error = assert_error(post({"prompt": "x", "max_tokens": server.engine.max_model_len}), 400)
    assert "max_tokens" in error["message"]
    assert_error(post(b'{"prompt": "' + b"a" * (MAX_BODY_BYTES + 10) + b'"}'), 413)
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/completions"), 405)
    bad_key = httpx.post(
        server.api_url + "/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer x"}
    )
    assert_error(bad_key, 401)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=PARIS, max_tokens=2)
    # Still serving.
    r = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_full_queue_is_503(server, http):
    config = server.engine.scheduler.config
    saved = config.max_waiting
    config.max_waiting = 0  # read by the engine thread on the next add
    try:
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        error = assert_error(r, 503)
        assert error["code"] == "queue_full"
    finally:
        config.max_waiting = saved
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_failing_step_is_a_500_without_traceback_and_the_server_recovers(server, http):
    engine = server.engine
    real_step = engine.step

    def broken_step():
        raise RuntimeError("secret internal detail")

    engine.step = broken_step
    try:
        r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    finally:
        del engine.step
    assert engine.step == real_step
    error = assert_error(r, 500)
    assert "secret" not in r.text
    assert error["type"] == "server_error"
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert metric(http, "kv_cache_usage_perc") == 0


# -- load ---------------------------------------------------------------------------------------


def test_64_streams_a_quarter_disconnecting(server, http):
    async def one(client: openai.AsyncOpenAI, i: int) -> str | None:
        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": f"Count to {i}."}],
            max_tokens=12,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
                if i % 4 == 0:  # a quarter of the clients hang up mid-stream
                    await stream.close()
                    return None
        return "".join(text)

    async def main() -> list[str | None]:
        async with openai.AsyncOpenAI(
            base_url=server.api_url, api_key=API_KEY, timeout=120, max_retries=0
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    finished = [r for i, r in enumerate(results) if i % 4]
    assert len(finished) == 48 and all(finished)
    assert all(r is None for i, r in enumerate(results) if i % 4 == 0)
    # The disconnects are noticed at the next write, at most a step later.
    for _ in range(50):
        if metric(http, "num_requests_running") == 0 and metric(http, "kv_cache_usage_perc") == 0:
            break
        time.sleep(0.1)
    assert metric(http, "kv_cache_usage_perc") == 0
    assert metric(http, "num_requests_running") == 0
    assert http.get("/health").status_code == 200


def test_non_streaming_client_that_hangs_up_is_aborted(server, http):
    body = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, timeout=1.0)
    # 400 tokens take far longer than this on CPU: only an abort empties the batch this fast.
    deadline = time.monotonic() + 5
    while metric(http, "num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(http, "num_requests_running") == 0
    assert metric(http, "kv_cache_usage_perc") == 0
