"""Prompt logprobs (SamplingParams.prompt_logprobs, RequestOutput.prompt_logprobs) against HF's
own logits, log_softmax over the vocabulary in float32 on CPU: under default settings, chunked
prefill, preemption by recompute, a prefix shared with an earlier request, n=2 and a prompt
scored in more than one slice of rows, for tiny models and the real SmolLM2."""

from __future__ import annotations

import pytest
import torch

from compile_engine import LLM, SamplingParams
from compile_engine.runtime.prompt_logprobs import PromptScores, scored_span
from compile_engine.runtime.request import Request
from compile_engine.runtime.sampler import prompt_token_logprobs
from compile_engine.runtime.sampling_params import InvalidSamplingParams

from oracle import NEW_TOKENS, hf_greedy, mixed_prompts
from tiny_models import make_tiny_model

TOL = 1e-4
KS = [0, 1, 5, 20]  # a different k for neighbouring prompts: one batch mixes them


def hf_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """[P, V]: row i is HF's log-distribution of the token after prompt[: i + 1]."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def check_against_hf(entries, reference: torch.Tensor, prompt: list[int], k: int) -> float:
    """Every entry against HF's row before it; returns the largest logprob difference."""
    assert len(entries) == len(prompt) and entries[0] is None
    worst = 0.0
    for j in range(1, len(prompt)):
        entry, row = entries[j], reference[j - 1]
        assert entry.token_id == prompt[j]
        worst = max(worst, abs(entry.logprob - row[prompt[j]].item()))
        top_values = row.topk(k).values.tolist()
        assert len(entry.top) == k
        assert [v for _, v in entry.top] == pytest.approx(top_values, abs=TOL)
        for token, value in entry.top:  # ids checked through their values: ties may reorder
            assert row[token].item() == pytest.approx(value, abs=TOL)
        # Rank: 1 + the tokens more likely, ties within the tolerance either way.
        surely_above = int((row > entry.logprob + TOL).sum())
        maybe_above = int((row >= entry.logprob - TOL).sum())
        assert surely_above + 1 <= entry.rank <= maybe_above
    assert worst <= TOL
    return worst


def greedy(k: int | None, **fields) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=k, **fields
    )


class ScoreSpy:
    """Records the (first token, count) of every chunk of scores the runner hands back."""

    def __init__(self, runner) -> None:
        self.chunks: dict[str, list[tuple[int, int]]] = {}
        self._collect = runner.collect
        runner.collect = self

    def __call__(self, flight):
        result = self._collect(flight)
        for rid, (first, scores) in result.prompt_logprobs.items():
            self.chunks.setdefault(rid, []).append((first, len(scores)))
        return result

    def repeated(self) -> bool:
        """Whether some request was handed scores it already had (a recompute)."""
        for spans in self.chunks.values():
            held = 1
            for first, count in spans:
                if first < held:
                    return True
                held = max(held, first + count)
        return False


# -- the pieces ---------------------------------------------------------------------------


def test_sampling_params_take_prompt_logprobs_in_range():
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(InvalidSamplingParams, match=r"prompt_logprobs=.* \[0, 20\]"):
            SamplingParams(prompt_logprobs=bad)


def test_scored_span_covers_each_prompt_token_but_the_first_once():
    request = Request("r", list(range(10)), SamplingParams(prompt_logprobs=1))
    spans = [scored_span(request, s, n) for s, n in [(0, 4), (4, 4), (8, 2)]]
    assert spans == [(1, 4), (5, 4), (9, 1)]  # the last position scores no prompt token
    assert scored_span(request, 0, 1) == (1, 1)
    request.append_output_token(3)  # its first token is out: nothing left to score
    assert scored_span(request, 0, 11) == (1, 0)
    sibling = Request("r#1", [1, 2, 3], SamplingParams(n=2, prompt_logprobs=1), sibling_index=1)
    assert scored_span(sibling, 0, 3) == (1, 0)  # sibling 0 scores the shared prompt
    assert scored_span(Request("q", [1, 2], SamplingParams()), 0, 2) == (1, 0)


def test_prompt_scores_drop_a_recomputes_repeats_and_refuse_a_hole():
    scores = PromptScores(6)
    scores.add(1, ["a", "b"])
    scores.add(1, ["x"])  # recomputed from the start after preemption
    scores.add(2, ["y", "c"])
    assert scores.entries == [None, "a", "b", "c"] and not scores.complete
    with pytest.raises(RuntimeError, match="lost"):
        scores.add(5, ["e"])
    scores.add(4, ["d", "e"])
    assert scores.complete
    assert PromptScores(1).complete  # a one-token prompt has nothing to score


def test_prompt_token_logprobs_scores_the_given_tokens():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [3.0, 0.0, 0.0, -1.0]])
    chosen, rank, top_ids, top_values = prompt_token_logprobs(logits, torch.tensor([2, 0]), 2)
    reference = torch.log_softmax(logits, dim=-1)
    assert chosen.tolist() == [reference[0, 2].item(), reference[1, 0].item()]
    assert rank.tolist() == [3, 1]  # two tokens above the first row's; none above the second's
    assert top_values.tolist() == reference.topk(2).values.tolist()
    assert top_ids[1].tolist()[0] == 0
    # The most likely token's logprob is the top value bit for bit (lm-eval's is_greedy).
    assert chosen[1].item() == top_values[1, 0].item()


# -- tiny models against HF ---------------------------------------------------------------

SCENARIOS = {
    "default": dict(),
    "chunked-budget-16": dict(max_num_batched_tokens=16),
    # A pool this small preempts requests part-way through their prompts (the spy checks).
    "preemption": dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=16),
}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return directory, make_tiny_model(request.param, directory)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_prompt_logprobs_equal_hf(tiny, scenario):
    directory, hf_model = tiny
    llm = LLM(
        str(directory), dtype="float32", target="cpu", enforce_eager=True, **SCENARIOS[scenario]
    )
    spy = ScoreSpy(llm.engine.runner)
    prompts = mixed_prompts(hf_model.config.vocab_size, seed=4)
    ks = [KS[i % len(KS)] for i in range(len(prompts))]
    ks[3] = None  # one request in the batch does not ask
    outs = llm.generate(prompts, [greedy(k) for k in ks])
    for prompt, k, out in zip(prompts, ks, outs, strict=True):
        # Scoring the prompt changes nothing about the tokens sampled after it.
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS)
        if k is None:
            assert out.prompt_logprobs is None
            continue
        check_against_hf(out.prompt_logprobs, hf_logprobs(hf_model, prompt), prompt, k)
    stats = llm.engine.stats()
    if scenario == "preemption":
        assert stats.num_preemptions_total > 0
        assert spy.repeated(), "no request was preempted while scoring its prompt"
    if scenario == "chunked-budget-16":
        assert max(len(spans) for spans in spy.chunks.values()) > 1, "no prompt was chunked"
    assert stats.kv_cache_usage == 0.0
    llm.engine.scheduler.check_integrity()


def test_a_cached_prefix_is_recomputed_and_scored(tiny):
    """A prompt that shares 13 tokens with an earlier request's: without prompt logprobs its
    cached blocks are hit; with them, it skips the cache and scores every token."""
    directory, hf_model = tiny
    llm = LLM(str(directory), dtype="float32", target="cpu", block_size=4, enforce_eager=True)
    prompts = mixed_prompts(hf_model.config.vocab_size, seed=5, shared_prefix=13)
    llm.generate(prompts[:1], greedy(None))  # caches the shared prefix's blocks
    before = llm.engine.stats().prefix_cache_hits
    outs = llm.generate(prompts[1:], greedy(3))
    assert llm.engine.stats().prefix_cache_hits == before
    for prompt, out in zip(prompts[1:], outs, strict=True):
        check_against_hf(out.prompt_logprobs, hf_logprobs(hf_model, prompt), prompt, 3)
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS)
    llm.generate(prompts[1:2], greedy(None))  # the cache is still there for those that read it
    assert llm.engine.stats().prefix_cache_hits > before


def test_siblings_share_one_scored_prompt(tiny):
    directory, hf_model = tiny
    llm = LLM(str(directory), dtype="float32", target="cpu", block_size=4, enforce_eager=True)
    spy = ScoreSpy(llm.engine.runner)
    prompt = mixed_prompts(hf_model.config.vocab_size, seed=6)[3]
    out = llm.generate([prompt], greedy(2, n=2))[0]
    check_against_hf(out.prompt_logprobs, hf_logprobs(hf_model, prompt), prompt, 2)
    assert out.outputs[0].token_ids == out.outputs[1].token_ids
    assert sum(n for spans in spy.chunks.values() for _, n in spans) == len(prompt) - 1


def test_a_long_chunk_is_scored_in_slices_and_outputs_wait_for_the_whole_prompt(tiny):
    """300 prompt rows in one chunk (more than one slice of PROMPT_LOGPROB_ROWS), then the
    same prompt in chunks of 64: no output leaves the engine before its prompt is scored."""
    directory, hf_model = tiny
    prompt = [3 + (i * 37) % (hf_model.config.vocab_size - 3) for i in range(300)]
    reference = hf_logprobs(hf_model, prompt)
    for budget in (2048, 64):
        llm = LLM(
            str(directory),
            dtype="float32",
            target="cpu",
            enforce_eager=True,
            max_num_batched_tokens=budget,
        )
        engine = llm.engine
        engine.add_request("long", prompt, SamplingParams(max_tokens=3, prompt_logprobs=4))
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert outputs and all(len(o.prompt_logprobs) == len(prompt) for o in outputs)
        check_against_hf(outputs[-1].prompt_logprobs, reference, prompt, 4)


# -- SmolLM2 against HF -------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_prompt_logprobs_equal_hf(smollm2_llm, smollm2_hf, smollm2_tokenizer):
    text = "The quick brown fox jumps over the lazy dog. The capital of France is Paris."
    prompt = list(smollm2_tokenizer.encode(text))
    out = smollm2_llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=5))[0]
    check_against_hf(out.prompt_logprobs, hf_logprobs(smollm2_hf, prompt), prompt, 5)


@pytest.mark.slow
def test_smollm2_chunked_with_a_shared_prefix_equals_hf(smollm2_hf, smollm2_tokenizer):
    """Chunks of 16 tokens, and a prompt whose first blocks an earlier request cached."""
    llm = LLM(
        "smollm2-135m",
        dtype="float32",
        target="cpu",
        enforce_eager=True,
        block_size=4,
        num_kv_blocks=128,
        max_num_batched_tokens=16,
    )
    shared = "Question: which planet is known as the red planet? Answer:"
    first, second = (list(smollm2_tokenizer.encode(shared + a)) for a in (" Mars", " Venus"))
    llm.generate([first], SamplingParams(max_tokens=1))
    before = llm.engine.stats().prefix_cache_hits
    out = llm.generate([second], SamplingParams(max_tokens=2, prompt_logprobs=3))[0]
    assert llm.engine.stats().prefix_cache_hits == before  # the cached prefix was recomputed
    check_against_hf(out.prompt_logprobs, hf_logprobs(smollm2_hf, second), second, 3)
