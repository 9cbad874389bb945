"""The server answers what the offline `LLM.generate` computes for the same request: the same
text, the same tokens (the API carries each token as its own decoded text), the same logprobs and
top logprobs, and the prompt's text and tokens under `echo`, streamed or not.

Every prompt here is used by no other test, and each server request carries its own cache_salt:
both sides then compute the whole prompt, with no prefix-cache hit on one side only, and greedy
decoding picks the same tokens. The expected values are computed on the server's engine thread
(`RunningServer.in_engine_thread`), the one thread that uses the engine and its tokenizer.
"""

from __future__ import annotations

import itertools
import json
import uuid
from dataclasses import dataclass

import pytest

from compile_engine.runtime.sampling_params import SamplingParams

from server_harness import MODEL_NAME

# Both sides run the same float32 CPU kernels on the same shapes; the tolerance only absorbs
# the rounding of a different batch, should the engine ever pad one differently.
TOL = 1e-4


@dataclass
class Offline:
    """What LLM.generate returned for one prompt, with every token's own text."""

    prompt_ids: list[int]
    prompt_text: str  # decode(prompt_ids), which is what echo shows of a token-id prompt
    prompt_token_texts: list[str]
    text: str
    token_ids: list[int]
    token_texts: list[str]
    logprobs: list[float]
    top: list[list[tuple[str, float]]]  # most likely first
    finish_reason: str | None
    # With prompt_logprobs: per prompt token, None for the first, as logprobs and top above.
    prompt_logprobs: list[float | None]
    prompt_top: list[list[tuple[str, float]] | None]


def offline(server, llm, prompt, params: SamplingParams, chat: bool = False) -> Offline:
    def run() -> Offline:
        tok = llm.tokenizer
        out = (llm.chat(prompt, params) if chat else llm.generate(prompt, params))[0]
        c = out.outputs[0]

        def texts(ids: list[int]) -> list[str]:
            return [tok.decode([t], skip_special_tokens=False) for t in ids]

        entries = c.logprobs or []
        scores = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        return Offline(
            prompt_ids=list(out.prompt_token_ids),
            prompt_text=tok.decode(out.prompt_token_ids),
            prompt_token_texts=texts(out.prompt_token_ids),
            text=c.text,
            token_ids=list(c.token_ids),
            token_texts=texts(c.token_ids),
            logprobs=[e.logprob for e in entries],
            top=[[(texts([t])[0], lp) for t, lp in e.top] for e in entries],
            finish_reason=c.finish_reason,
            prompt_logprobs=[e.logprob if e else None for e in scores],
            prompt_top=[[(texts([t])[0], lp) for t, lp in e.top] if e else None for e in scores],
        )

    return server.in_engine_thread(run)


def greedy(**fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, **fields)


def salt() -> dict:
    return {"cache_salt": uuid.uuid4().hex}


def offsets(texts: list[str]) -> list[int]:
    return [0, *itertools.accumulate(len(t) for t in texts)][:-1]


def assert_completion_logprobs(lp, want: Offline, k: int, echo: bool) -> None:
    """OpenAI's legacy completions logprobs against the offline run; with echo the prompt's
    tokens come first, scored as the offline run's prompt_logprobs (the first one null)."""
    texts, logprobs, tops = want.token_texts, want.logprobs, want.top
    if echo:
        texts = want.prompt_token_texts + texts
        logprobs = want.prompt_logprobs + logprobs
        tops = want.prompt_top + tops
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens == texts
    assert lp.text_offset == offsets(lp.tokens)
    rows = zip(lp.token_logprobs, lp.top_logprobs, texts, logprobs, tops, strict=True)
    for got, got_top, text, logprob, top in rows:
        if logprob is None:
            assert got is None and got_top is None
            continue
        assert got == pytest.approx(logprob, abs=TOL)
        expected = dict(top[:k])
        expected.setdefault(text, logprob)  # the chosen token is always there
        assert got_top == pytest.approx(expected, abs=TOL)


def merged_stream_logprobs(chunks) -> dict:
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        lp = chunk.choices[0].logprobs
        if lp is not None:
            for key in merged:
                merged[key] += getattr(lp, key)
    return merged


# -- /v1/completions ------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 3])
def test_completion_logprobs_equal_generate(server, client, smollm2_llm, k):
    prompt = f"A short list of {k + 2} rivers in Europe:"
    want = offline(server, smollm2_llm, prompt, greedy(max_tokens=8, logprobs=k))
    kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, logprobs=k)
    r = client.completions.create(**kwargs, extra_body=salt())
    choice = r.choices[0]
    assert choice.text == want.text and choice.finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(want.prompt_ids)
    assert r.usage.completion_tokens == len(want.token_ids) == 8
    assert_completion_logprobs(choice.logprobs, want, k, echo=False)

    chunks = list(client.completions.create(**kwargs, stream=True, extra_body=salt()))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert merged_stream_logprobs(chunks) == choice.logprobs.model_dump()


def test_echo_equals_prompt_and_generate(server, client, smollm2_llm):
    prompt = "Three colours of the rainbow are"
    want = offline(server, smollm2_llm, prompt, greedy(max_tokens=6))
    kwargs = dict(model=MODEL_NAME, max_tokens=6, temperature=0, echo=True)
    r = client.completions.create(prompt=prompt, **kwargs, extra_body=salt())
    assert r.choices[0].text == prompt + want.text and r.choices[0].logprobs is None
    # A token-id prompt echoes as the tokenizer decodes it.
    ids = client.completions.create(prompt=want.prompt_ids, **kwargs, extra_body=salt())
    assert ids.choices[0].text == want.prompt_text + want.text
    chunks = list(client.completions.create(prompt=want.prompt_ids, stream=True, **kwargs))
    assert chunks[0].choices[0].text.startswith(want.prompt_text)
    assert "".join(c.choices[0].text for c in chunks) == want.prompt_text + want.text


def test_echo_with_logprobs_equals_prompt_and_generate(server, client, smollm2_llm):
    """vLLM's echo: the prompt's tokens scored as prompt_logprobs=logprobs scores them."""
    prompt = "The tallest mountain in Africa is"
    params = greedy(max_tokens=5, logprobs=2, prompt_logprobs=2)
    want = offline(server, smollm2_llm, prompt, params)
    kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0, logprobs=2)
    kwargs |= {"echo": True}
    choice = client.completions.create(**kwargs, extra_body=salt()).choices[0]
    assert choice.text == prompt + want.text
    assert_completion_logprobs(choice.logprobs, want, 2, echo=True)
    # SmolLM2's prompt and answer are ASCII here: every token is whole characters.
    assert "".join(choice.logprobs.tokens) == choice.text

    chunks = list(client.completions.create(**kwargs, stream=True, extra_body=salt()))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert merged_stream_logprobs(chunks) == choice.logprobs.model_dump()


# -- /v1/chat/completions -------------------------------------------------------------------------


@pytest.mark.parametrize("top_logprobs", [None, 4])
def test_chat_logprobs_equal_generate(server, client, smollm2_llm, top_logprobs):
    messages = [{"role": "user", "content": f"Name {top_logprobs or 2} kinds of tree."}]
    k = top_logprobs or 0
    want = offline(server, smollm2_llm, messages, greedy(max_tokens=7, logprobs=k), chat=True)
    kwargs = dict(model=MODEL_NAME, messages=messages, max_tokens=7, temperature=0)
    kwargs |= {"logprobs": True, "top_logprobs": top_logprobs}
    r = client.chat.completions.create(**kwargs, extra_body=salt())
    choice = r.choices[0]
    assert choice.message.content == want.text and choice.finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(want.prompt_ids)
    content = choice.logprobs.content
    assert [e.token for e in content] == want.token_texts
    assert [e.logprob for e in content] == pytest.approx(want.logprobs, abs=TOL)
    assert [e.bytes for e in content] == [list(t.encode()) for t in want.token_texts]
    for entry, top in zip(content, want.top, strict=True):
        assert [t.token for t in entry.top_logprobs] == [text for text, _ in top[:k]]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [lp for _, lp in top[:k]], abs=TOL
        )
        assert all(t.bytes == list(t.token.encode()) for t in entry.top_logprobs)

    chunks = list(client.chat.completions.create(**kwargs, stream=True, extra_body=salt()))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]


def test_tokenize_equals_the_tokenizer(server, http, smollm2_llm):
    """/tokenize and /detokenize against the tokenizer itself (on the engine thread)."""
    messages = [{"role": "user", "content": "Which planet has rings?"}]
    text = "Saturn's rings, mostly ice"

    def run() -> tuple:
        tok = smollm2_llm.tokenizer
        ids = list(tok.encode(text, add_special_tokens=True))
        return ids, smollm2_llm.apply_chat_template(messages), tok.decode(ids)

    ids, chat_ids, decoded = server.in_engine_thread(run)
    got = http.post("/tokenize", json={"prompt": text}).json()
    assert got == {"tokens": ids, "count": len(ids), "max_model_len": server.engine.max_model_len}
    assert http.post("/tokenize", json={"messages": messages}).json()["tokens"] == chat_ids
    body = json.dumps({"tokens": ids})
    r = http.post("/detokenize", content=body, headers={"Content-Type": "application/json"})
    assert r.json() == {"prompt": decoded} and decoded == text
