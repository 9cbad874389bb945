"""Prompt logprobs over HTTP, as vLLM answers them: `echo` with `logprobs` scores the prompt's
tokens (the first has none), vLLM's `prompt_logprobs` field on completions and chat, and `echo`
with `max_tokens: 0`, which scores the prompt only. The scores are HF's (SmolLM2, float32, CPU),
and EleutherAI's lm-evaluation-harness scores a small multiple-choice task through the server
(its `local-completions` model) to the same answers as its `hf` model on the same weights.
"""

from __future__ import annotations

import json
import os
import uuid

import pytest
import torch

from compile_engine.runtime.sampling_params import SamplingParams

from server_harness import API_KEY, MODEL_NAME, assert_error

TOL = 1e-4  # per token, float32 on CPU against HF's own forward


def completion(http, **body) -> dict:
    body = {"model": MODEL_NAME, "temperature": 0, "cache_salt": uuid.uuid4().hex} | body
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[P, V]: row i is HF's log-distribution of the token after ids[: i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def offsets(texts: list[str]) -> list[int]:
    out, at = [], 0
    for text in texts:
        out.append(at)
        at += len(text)
    return out


def test_echo_with_logprobs_scores_the_prompt_as_hf_does(http, smollm2_hf, smollm2_tokenizer):
    """lm-eval's loglikelihood request: the prompt's tokens come back with HF's logprobs (the
    first null), top_logprobs holding the k most likely and the token itself, text offsets
    and token texts, then the generated tokens; vLLM's prompt_logprobs beside them."""
    ids = list(smollm2_tokenizer.encode("The Eiffel Tower stands in the city of"))
    choice = completion(http, prompt=ids, max_tokens=2, logprobs=3, echo=True)["choices"][0]
    lp, reference = choice["logprobs"], hf_logprobs(smollm2_hf, ids)
    assert len(lp["tokens"]) == len(ids) + 2
    assert lp["text_offset"] == offsets(lp["tokens"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x is not None for x in lp["token_logprobs"][1:])
    for j in range(1, len(ids)):
        row = reference[j - 1]
        assert lp["token_logprobs"][j] == pytest.approx(row[ids[j]].item(), abs=TOL)
        top = lp["top_logprobs"][j]
        assert lp["tokens"][j] in top and len(top) in (3, 4)
        best = sorted(top.values(), reverse=True)[:3]
        assert best == pytest.approx(row.topk(3).values.tolist(), abs=TOL)

    scores = choice["prompt_logprobs"]  # vLLM's own field: by token id, with ranks
    assert len(scores) == len(ids) and scores[0] is None
    for j in range(1, len(ids)):
        mine = scores[j][str(ids[j])]
        assert mine["logprob"] == lp["token_logprobs"][j]
        assert mine["decoded_token"] == lp["tokens"][j]
        assert mine["rank"] == int((reference[j - 1] >= reference[j - 1, ids[j]]).sum())
        assert sorted(e["rank"] for e in scores[j].values())[:3] == [1, 2, 3]


def test_prompt_logprobs_field_equals_generate(server, http, smollm2_llm):
    prompt = "Rivers of Europe include the Danube and the"
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    want = server.in_engine_thread(lambda: smollm2_llm.generate(prompt, params)[0])
    choice = completion(http, prompt=prompt, max_tokens=3, prompt_logprobs=2)["choices"][0]
    assert choice["text"] == want.outputs[0].text and choice["logprobs"] is None
    got = choice["prompt_logprobs"]
    assert len(got) == len(want.prompt_token_ids) and got[0] is None
    for scores, entry in zip(got[1:], want.prompt_logprobs[1:], strict=True):
        expected = {entry.token_id: (entry.logprob, entry.rank)}
        for rank, (t, value) in enumerate(entry.top, 1):
            expected.setdefault(t, (value, rank))
        assert {int(t): e["rank"] for t, e in scores.items()} == {
            t: rank for t, (_, rank) in expected.items()
        }
        assert {int(t): e["logprob"] for t, e in scores.items()} == pytest.approx(
            {t: value for t, (value, _) in expected.items()}, abs=TOL
        )


def test_chat_prompt_logprobs_score_the_templated_prompt(http):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi there"}]}
    body |= {"max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    scores = answer["prompt_logprobs"]  # at the top of the response, as vLLM puts it
    assert len(scores) == answer["usage"]["prompt_tokens"] and scores[0] is None
    assert all(1 <= len(s) <= 2 and all(e["logprob"] <= 0 for e in s.values()) for s in scores[1:])


def test_echo_with_max_tokens_0_scores_the_prompt_only(client, http):
    prompt = "Paris is the capital of France."
    body = completion(http, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = body["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == body["usage"]["prompt_tokens"]
    assert lp["token_logprobs"][0] is None and None not in lp["token_logprobs"][1:]
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"]
    assert completion(http, prompt=prompt, max_tokens=0, echo=True)["choices"][0]["text"] == prompt

    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=0,
            echo=True,
            logprobs=1,
            stream=True,
            stream_options={"include_usage": True},
            temperature=0,
        )
    )
    assert chunks[-1].usage.completion_tokens == 0 and chunks[-1].choices == []
    assert "".join(c.choices[0].text for c in chunks[:-1]) == prompt
    assert chunks[-2].choices[0].finish_reason == "length"
    merged = {key: [] for key in lp}
    for c in chunks[:-1]:
        if c.choices[0].logprobs is not None:
            for key in merged:
                merged[key] += getattr(c.choices[0].logprobs, key)
    assert merged == lp


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),  # without echo
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": True}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": "1"}, "prompt_logprobs"),
        (
            "/v1/completions",
            {"prompt": "x", "prompt_logprobs": 1, "stream": True},
            "prompt_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 2, "stream": True},
            "prompt_logprobs",
        ),
    ],
)
def test_bad_prompt_scoring_requests_are_400(http, path, body, param):
    r = http.post(path, content=json.dumps({"max_tokens": 1} | body))
    assert_error(r, 400, param)


def test_prompt_logprobs_0_with_stream_is_accepted(client):
    chunks = client.completions.create(
        model=MODEL_NAME, prompt="x", max_tokens=1, stream=True, extra_body={"prompt_logprobs": 0}
    )
    assert list(chunks)[-1].choices[0].finish_reason == "length"


# -- lm-evaluation-harness ----------------------------------------------------------------

QUESTIONS = [
    ("What is the capital of France?", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("How many legs does a spider have?", ["six", "eight"], 1),
    ("Which planet is known as the red planet?", ["Venus", "Jupiter", "Mars"], 2),
    ("What do bees make?", ["honey", "milk", "silk"], 0),
    ("Which is the largest ocean on Earth?", ["the Atlantic", "the Indian", "the Pacific"], 2),
    ("What is frozen water called?", ["steam", "ice"], 1),
    ("How many days are in a week?", ["five", "seven", "ten", "twelve"], 1),
    ("Which animal is called the king of the jungle?", ["the lion", "the mouse", "the cow"], 0),
]


def lm_eval_or_skip():
    try:
        import lm_eval
    except ImportError:
        message = "lm-eval is not installed (pip install 'lm-eval[api]==0.4.13', the dev extra)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return lm_eval


@pytest.mark.slow
def test_lm_eval_local_completions_picks_hf_answers(
    server, smollm2_hf, smollm2_tokenizer, tmp_path
):
    """The harness's own loglikelihood path (local-completions: token-id prompts batched four
    to a request, echo, logprobs 1, max_tokens 1, token_logprobs summed over the continuation,
    is_greedy from top_logprobs) against its hf model on the same float32 SmolLM2."""
    lm_eval = lm_eval_or_skip()
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    data = tmp_path / "mc.jsonl"
    rows = [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    task = {
        "task": "compile_engine_mc",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(tmp_path / "hf")},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
    }
    smollm2_tokenizer.save_pretrained(tmp_path / "tokenizer")
    ours = LocalCompletionsAPI(
        base_url=server.api_url + "/completions",
        model=MODEL_NAME,
        tokenizer=str(tmp_path / "tokenizer"),
        tokenizer_backend="huggingface",
        batch_size=4,
        header={"Authorization": f"Bearer {API_KEY}"},
    )
    hf = HFLM(pretrained=smollm2_hf, tokenizer=smollm2_tokenizer, batch_size=1, device="cpu")
    results = {
        name: lm_eval.simple_evaluate(model=model, tasks=[task], log_samples=True)
        for name, model in (("ours", ours), ("hf", hf))
    }
    samples = {name: r["samples"]["compile_engine_mc"] for name, r in results.items()}
    assert len(samples["ours"]) == len(samples["hf"]) == len(QUESTIONS)
    for mine, theirs in zip(samples["ours"], samples["hf"], strict=True):
        assert mine["doc_id"] == theirs["doc_id"]
        got = [resp[0] for resp in mine["resps"]]  # (loglikelihood, is_greedy) per choice
        want = [resp[0] for resp in theirs["resps"]]
        assert [g for _, g in got] == [g for _, g in want]
        assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in want], abs=1e-3)
        for metric in ("acc", "acc_norm"):
            assert mine[metric] == theirs[metric], (mine["doc"], metric)
    ours_scores, hf_scores = (results[n]["results"]["compile_engine_mc"] for n in ("ours", "hf"))
    for metric in ("acc,none", "acc_norm,none"):
        assert ours_scores[metric] == hf_scores[metric]
    assert hf_scores["acc,none"] > 0  # the task is not vacuous: SmolLM2 gets some right
