"""Async scheduling (one step in flight) gives exactly the tokens of synchronous stepping:
greedy and seeded sampling, eos and stop tokens, min_tokens, n=2, preemption by a small pool,
abort mid-flight; and a penalty request makes the engine step synchronously."""

from __future__ import annotations

import random

import pytest

from compile_engine import LLM, SamplingParams

from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama-async")
    hf_model = make_tiny_model("llama", directory)
    return directory, hf_model.config.vocab_size


def _requests(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(7)
    out = []
    for i in range(14):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(3, 40))]
        kind = i % 5
        if kind == 0:
            params = SamplingParams(temperature=0, max_tokens=rng.randrange(1, 24))
        elif kind == 1:
            params = SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=20)
        elif kind == 2:  # stops early on frequent tokens, at least 3 first
            params = SamplingParams(
                temperature=1.0, seed=i, max_tokens=30, stop_token_ids=[1, 2, 3], min_tokens=3
            )
        elif kind == 3:
            params = SamplingParams(temperature=0.7, seed=i, n=2, max_tokens=12)
        else:
            params = SamplingParams(temperature=0, max_tokens=16, logprobs=2)
        out.append((prompt, params))
    return out


def _run(directory, async_scheduling: bool, **engine) -> list:
    llm = LLM(
        str(directory),
        dtype="float32",
        target="cpu",
        enforce_eager=True,
        async_scheduling=async_scheduling,
        **engine,
    )
    prompts, params = zip(*_requests(llm.engine.model_config.vocab_size), strict=True)
    outs = llm.generate(list(prompts), list(params))
    llm.engine.scheduler.check_integrity()
    assert llm.engine.stats().kv_cache_usage == 0.0
    seen = [
        [(c.token_ids, c.finish_reason, [lp.token_id for lp in c.logprobs or []]) for c in out]
        for out in (o.outputs for o in outs)
    ]
    return seen, llm


@pytest.mark.parametrize(
    "engine",
    [dict(), dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=32)],
    ids=["default", "preemption"],
)
def test_async_equals_sync(tiny_dir, engine):
    directory, _ = tiny_dir
    sync, _ = _run(directory, False, **engine)
    overlapped, llm = _run(directory, True, **engine)
    assert overlapped == sync
    if engine:
        assert llm.engine.stats().num_preemptions_total > 0, "the small pool should preempt"


def test_outputs_trail_launches_by_one_step_and_penalties_step_synchronously(tiny_dir):
    directory, vocab = tiny_dir
    llm = LLM(str(directory), dtype="float32", target="cpu", enforce_eager=True)
    engine = llm.engine
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4))
    assert engine.step() == []  # the prefill is in flight; nothing has landed
    assert engine.has_unfinished_requests()
    first = engine.step()
    assert [o.request_id for o in first] == ["a"] and len(first[0].outputs[0].token_ids) == 1
    engine.add_request("p", [5, 6, 7], SamplingParams(temperature=0, repetition_penalty=1.3))
    # With a penalty request live, each step's tokens come back from the same call.
    outs = engine.step()  # lands the step in flight, then runs this one synchronously
    assert {o.request_id for o in outs} == {"a", "p"}
    assert engine._in_flight is None
    engine.abort_request("p")
    while engine.has_unfinished_requests():
        engine.step()
    engine.scheduler.check_integrity()


def test_abort_while_its_step_is_in_flight(tiny_dir):
    directory, _ = tiny_dir
    llm = LLM(str(directory), dtype="float32", target="cpu", enforce_eager=True)
    engine = llm.engine
    for rid in ("x", "y"):
        engine.add_request(rid, [9, 8, 7, 6], SamplingParams(temperature=0, max_tokens=8))
    engine.step()
    engine.step()
    engine.abort_request("x")  # x has a token in flight
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "y", "an aborted request must not report again"
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert len(finished["y"]) == 8
    assert engine.stats().kv_cache_usage == 0.0
    engine.scheduler.check_integrity()


def test_decode_steps_take_the_step_aheads_tokens_as_they_are(tiny_dir):
    # Pure decode steps of the requests the step ahead sampled, in its order, feed its token
    # tensor straight in (no index copies); the tokens are those of synchronous stepping.
    directory, vocab = tiny_dir
    rng = random.Random(3)
    prompts = [[rng.randrange(vocab) for _ in range(9)] for _ in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=12 + 3 * i) for i in range(5)]
    runs = {}
    for overlap in (False, True):
        llm = LLM(
            str(directory), dtype="float32", target="cpu", enforce_eager=True,
            async_scheduling=overlap,
        )  # fmt: skip
        runner = llm.engine.runner
        taken, original = [], runner._input_ids

        def spy(inputs, previous, original=original, taken=taken):
            ids = original(inputs, previous)
            taken.append(previous is not None and ids is previous.token_ids)
            return ids

        runner._input_ids = spy
        outs = llm.generate(prompts, params)
        runs[overlap] = ([o.outputs[0].token_ids for o in outs], taken)
    (sync_tokens, sync_taken), (tokens, taken) = runs[False], runs[True]
    assert tokens == sync_tokens
    assert not any(sync_taken)  # nothing pending without a step in flight
    # Every decode step until the first request finishes, and again among the rest.
    assert sum(taken) >= 10, taken
