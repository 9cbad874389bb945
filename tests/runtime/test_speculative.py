"""Speculative decoding (#33): the config, the n-gram lookup, the rejection sampler's output
distribution against the target's (and a wrong rule failing the same check), and the engine:
greedy tokens with n-gram and draft-model speculation equal HF's for every tiny architecture,
under preemption, with max_tokens exact when every draft is accepted, n > 1, penalties,
min_tokens, logprobs, seeds, stop strings and grammars. SmolLM2 (slow): chat prompts and a stop
string."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from compile_engine import LLM, SamplingParams
from compile_engine.runtime.engine_args import add_engine_options, engine_kwargs
from compile_engine.runtime.engine_config import EngineConfig, EngineConfigError
from compile_engine.runtime.rejection_sampler import rejection_sample
from compile_engine.runtime.sampler import SamplingBatch
from compile_engine.runtime.spec_policy import Choice, SpeculationPolicy
from compile_engine.runtime.speculative import ngram_lookup

from oracle import GREEDY, NEW_TOKENS, hf_greedy, mixed_prompts
from tiny_deepseek import make_tiny_deepseek
from tiny_models import TINY_ARCHS, make_tiny_model
from tiny_moe import make_tiny_moe

NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
# Tests keep every request speculating at k (the acceptance cut-off has its own scheduler
# test; the per-step choice of k, test_spec_policy.py and the adaptive tests below).
ALWAYS = dict(min_acceptance_rate=0.0, adaptive=False)


def eager(directory, **settings) -> LLM:
    return LLM(str(directory), dtype="float32", target="cpu", enforce_eager=True, **settings)


def spec_prompts(vocab: int, seed: int) -> list[list[int]]:
    """Mixed lengths, and repetitive ones that n-gram lookup finds matches in."""
    rng = np.random.default_rng(seed)
    loops = [list(rng.integers(3, vocab, size=n)) * r for n, r in ((3, 4), (5, 3), (2, 6))]
    return mixed_prompts(vocab, seed)[:5] + [[int(t) for t in loop] for loop in loops]


# -- config -----------------------------------------------------------------------------------


def test_config_is_validated_with_vllms_names():
    config = EngineConfig(
        "x", target="cpu", speculative_config='{"method": "ngram", "num_speculative_tokens": 4}'
    )
    spec = config.speculative_config
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)  # vLLM's default
    one = EngineConfig(
        "x", target="cpu", speculative_config=dict(NGRAM, prompt_lookup_min=None)
    ).speculative_config
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)
    for method in ("eagle",):  # eagle3 and mtp: tests/runtime/test_speculative_heads.py
        with pytest.raises(EngineConfigError, match=f"method='{method}' is not implemented yet"):
            EngineConfig(
                "x",
                target="cpu",
                speculative_config={"method": method, "num_speculative_tokens": 2},
            )
    bad = [
        ({"method": "medusa", "num_speculative_tokens": 2}, "not supported"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model"),
        (dict(NGRAM, prompt_lookup_min=4), "exceeds prompt_lookup_max"),
        (dict(NGRAM, typo=1), "unknown setting"),
        ("{not json", "not valid JSON"),
    ]
    for value, message in bad:
        with pytest.raises(EngineConfigError, match=message):
            EngineConfig("x", target="cpu", speculative_config=value)
    with pytest.raises(EngineConfigError, match="does not run tensor-parallel yet"):
        EngineConfig("x", target="cpu", speculative_config=NGRAM, tensor_parallel_size=2)
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    args = parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    )
    assert EngineConfig("x", **engine_kwargs(args)).speculative_config.num_speculative_tokens == 2


def test_ngram_lookup_takes_the_most_recent_longest_match():
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3])
    # The last 2 tokens (2, 3) occur at 1 and 5: the most recent continues 7, 5, 2.
    assert ngram_lookup(tokens, 1, 2, 3) == [7, 5, 2]
    # With n = 3 allowed, (5, 2, 3) does not occur earlier; n = 2 still does.
    assert ngram_lookup(tokens, 2, 3, 2) == [7, 5]
    assert ngram_lookup(tokens, 3, 3, 2) == []
    assert ngram_lookup(np.array([4, 4]), 1, 3, 4) == [4]  # a continuation may reach the end
    assert ngram_lookup(np.array([4]), 1, 3, 4) == []


def _windows_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, every window compared: the reference of ngram_lookup's candidates."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


def test_ngram_lookup_equals_comparing_every_window():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        tokens = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 50)))
        min_n = int(rng.integers(1, 4))
        max_n, k = min_n + int(rng.integers(0, 4)), int(rng.integers(1, 8))
        assert ngram_lookup(tokens, min_n, max_n, k) == _windows_lookup(tokens, min_n, max_n, k)


def test_the_speculator_proposes_only_for_requests_that_can_take_drafts():
    from compile_engine.runtime.request import Request
    from compile_engine.runtime.speculative import NgramProposer, Speculator
    from compile_engine.runtime.speculative_config import SpeculativeConfig

    def decoding(rid: str, **params) -> Request:
        request = Request(rid, [1, 2, 3, 1, 2], SamplingParams(max_tokens=8, **params))
        request.append_output_token(3)  # ... 1, 2, 3: lookup continues 1, 2, 3
        request.num_computed_tokens = request.num_tokens - 1
        return request

    config = SpeculativeConfig(**dict(NGRAM, disable_by_batch_size=6))
    speculator = Speculator(config, NgramProposer(1, 3))
    plain, pending, off, grammar = (decoding(r) for r in "abcd")
    grammar.sampling_params = SamplingParams(max_tokens=8, structured_outputs={"regex": "a+"})
    pending.num_pending_tokens = 1
    off.spec_disabled = True
    prefill = Request("e", [1, 2, 3, 1, 2], SamplingParams(max_tokens=8))
    last = decoding("f")
    last.max_tokens = 1  # its one token is out: no room for drafts
    running = [plain, pending, off, grammar, prefill, last]
    cut = []
    speculator.propose(running[:5], lambda r: cut.append(r.request_id))
    assert [r.spec_token_ids for r in running] == [[1, 2, 3], [], [], [1, 2, 3], [], []]
    assert cut == ["d"]  # a grammar's request's drafts go to its check
    speculator.propose(running)  # six running: disable_by_batch_size
    assert all(not r.spec_token_ids for r in running)
    # A request with nothing to look up stops asking after acceptance_window (16) tries.
    lonely = decoding("g")
    lonely.all_token_ids[:] = [1, 2, 3, 4, 5, 6]
    for _ in range(16):
        assert not lonely.spec_disabled
        speculator.propose([lonely])
    assert lonely.spec_disabled and lonely.spec_idle and not lonely.spec_token_ids
    # Idle, it steps with a token in flight; its known tokens are looked up each step, and
    # a match makes it ask again.
    lonely.num_pending_tokens = 1
    speculator.propose([lonely])
    assert lonely.spec_idle  # 1..6 still has nothing to look up
    lonely.all_token_ids.append(4)  # ... 4, 5, 6, 4: the 4 continues 5, 6
    speculator.propose([lonely])
    assert not (lonely.spec_idle or lonely.spec_disabled or lonely.spec_token_ids)
    lonely.num_pending_tokens, lonely.num_computed_tokens = 0, len(lonely.all_token_ids) - 1
    speculator.propose([lonely])
    assert lonely.spec_token_ids == [5, 6, 4]


# -- the rejection sampler's distribution -----------------------------------------------------

V = 6
DRAWS = 60_000


def _verify(target: torch.Tensor, drafts: list[int], q: torch.Tensor | None, seed: int = 0):
    """Emitted tokens of DRAWS identical requests whose rows have logits `target` [1 + k, V]
    and the given drafts (a point mass, or drawn from q [k, V] by the caller per request)."""
    torch.manual_seed(seed)
    rows = target.shape[0]
    params = [SamplingParams(temperature=1.0)] * (DRAWS * rows)
    batch = SamplingBatch.build(
        params, [[1]] * len(params), [[]] * len(params), [None] * len(params), V, "cpu"
    )
    draft_ids = torch.tensor(drafts + [-1]).repeat(DRAWS)
    draft_probs = None
    if q is not None:
        draft_probs = torch.cat([q, torch.zeros(1, V)]).repeat(DRAWS, 1)
    logits = target.repeat(DRAWS, 1)
    out = rejection_sample(logits, batch, draft_ids, [rows] * DRAWS, draft_probs)
    first = out.token_ids.view(DRAWS, rows)[:, 0]
    return first, out.num_accepted, out.token_ids.view(DRAWS, rows)


def _tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=V).double()
    return 0.5 * (counts / counts.sum() - p.double()).abs().sum().item()


TARGET = torch.tensor(
    [[1.2, 0.3, -0.5, 0.9, -1.0, 0.1], [0.0, 1.5, 0.2, -0.3, 0.8, -2.0]], dtype=torch.float32
)
P = TARGET.softmax(-1)
# Noise of a TV estimate over 60k draws of 6 outcomes: ~0.005; a biased rule is off by > 0.1.
TV_BOUND = 0.012


def test_point_mass_drafts_keep_the_target_distribution():
    draft = 3  # p(3) = 0.24: rejected three times in four
    first, accepted, tokens = _verify(TARGET, [draft], None)
    assert _tv(first, P[0]) < TV_BOUND
    assert abs(accepted.float().mean().item() - P[0, draft].item()) < 0.01
    # After an accepted draft the bonus token comes from the next row's distribution.
    assert _tv(tokens[accepted == 1, 1], P[1]) < TV_BOUND


def test_sampled_drafts_keep_the_target_distribution():
    q = torch.tensor([[0.05, 0.05, 0.4, 0.3, 0.1, 0.1]])
    gen = torch.Generator().manual_seed(1)
    # Each request's draft drawn from q: run one batch per draft token, as many as q says.
    counts = torch.bincount(torch.multinomial(q[0], DRAWS, True, generator=gen), minlength=V)
    firsts = []
    for d in range(V):
        first, _, _ = _verify(TARGET, [d], q, seed=d)
        firsts.append(first[: counts[d]])
    assert _tv(torch.cat(firsts), P[0]) < TV_BOUND


def test_a_biased_rule_fails_the_same_bound():
    """The check has power: accepting with probability p(d) but redrawing from p itself
    (not p with d removed) over-weights the draft and fails the bound."""
    gen = torch.Generator().manual_seed(2)
    draft = 3
    accept = torch.rand(DRAWS, generator=gen) < P[0, draft]
    redraw = torch.multinomial(P[0], DRAWS, True, generator=gen)
    biased = torch.where(accept, torch.tensor(draft), redraw)
    assert _tv(biased, P[0]) > 5 * TV_BOUND


# -- the engine: greedy tokens as HF's --------------------------------------------------------


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A tiny Llama of another seed: the same vocabulary (96), drafts mostly rejected."""
    directory = tmp_path_factory.mktemp("draft")
    make_tiny_model("llama", directory, seed=7)
    return directory


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    return directory, make_tiny_model("llama", directory)


def _hf(hf_model, prompts, n: int = NEW_TOKENS) -> list[list[int]]:
    return [hf_greedy(hf_model, prompt, n) for prompt in prompts]


def _assert_greedy_as_hf(llm: LLM, prompts, want: list[list[int]], params=GREEDY) -> None:
    outs = llm.generate(prompts, params)
    for prompt, out, tokens in zip(prompts, outs, want, strict=True):
        assert all(o.token_ids == tokens for o in out.outputs), f"{len(prompt)}-token prompt"
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 0, "nothing was speculated"
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
    llm.engine.scheduler.check_integrity()


def _plain(directory, prompts) -> list[list[int]]:
    """The engine's own greedy tokens without speculation (equal to HF's:
    test_engine_equivalence.py), cheaper than asking HF for them."""
    return [o.outputs[0].token_ids for o in eager(directory).generate(prompts, GREEDY)]


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_greedy_equals_non_speculative_with_ngram_and_a_draft_model(arch, tmp_path, draft_dir):
    hf_model = make_tiny_model(arch, tmp_path)
    prompts = spec_prompts(hf_model.config.vocab_size, seed=1)
    want = _plain(tmp_path, prompts)
    _assert_greedy_as_hf(eager(tmp_path, speculative_config=dict(NGRAM, **ALWAYS)), prompts, want)
    # A draft model of another seed (drafts mostly rejected); the target as its own draft
    # (every draft accepted) has tests of its own below.
    spec = dict(method="draft_model", model=str(draft_dir), num_speculative_tokens=3, **ALWAYS)
    _assert_greedy_as_hf(eager(tmp_path, speculative_config=spec), prompts, want)


@pytest.mark.parametrize("arch", ["mixtral", "deepseek-v3"])
def test_greedy_equals_non_speculative_with_ngram_on_moe_and_mla(arch, tmp_path):
    make = make_tiny_deepseek if arch.startswith("deepseek") else make_tiny_moe
    hf_model = make(arch, tmp_path)
    prompts = spec_prompts(hf_model.config.vocab_size, seed=2)[:6]
    llm = eager(tmp_path, speculative_config=dict(NGRAM, **ALWAYS))
    _assert_greedy_as_hf(llm, prompts, _plain(tmp_path, prompts))


def test_preemption_in_a_small_pool_keeps_greedy_exact(llama):
    directory, hf_model = llama
    prompts = spec_prompts(hf_model.config.vocab_size, seed=3)
    small = dict(block_size=4, num_kv_blocks=22, max_num_batched_tokens=64)
    want = _hf(hf_model, prompts)
    for spec in (
        dict(NGRAM, **ALWAYS),
        dict(method="draft_model", model=str(directory), num_speculative_tokens=4, **ALWAYS),
    ):
        llm = eager(directory, speculative_config=spec, **small)
        _assert_greedy_as_hf(llm, prompts, want)
        assert llm.engine.stats().num_preemptions_total > 0


def test_max_tokens_is_exact_when_every_draft_is_accepted(llama):
    directory, hf_model = llama
    spec = dict(method="draft_model", model=str(directory), num_speculative_tokens=4, **ALWAYS)
    llm = eager(directory, speculative_config=spec)
    prompts = spec_prompts(hf_model.config.vocab_size, seed=4)
    want = _hf(hf_model, prompts, 7)
    for max_tokens in (1, 2, 6, 7):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for tokens, out in zip(want, llm.generate(prompts, params), strict=True):
            assert out.outputs[0].token_ids == tokens[:max_tokens]
            assert out.outputs[0].finish_reason == "length"
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
    assert stats.spec_accepted_per_pos[3] > 0  # four drafts accepted at once


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_verified_steps_text_comes_with_the_next_launch(llama, async_scheduling):
    """A step processed at once (speculation) hands its tokens to the scheduler at once, so
    the next step proposes and launches from them, and its text and outputs in the next
    call, after that launch; stepping synchronously, in its own call. Tokens as HF's."""
    directory, hf_model = llama
    spec = dict(method="draft_model", model=str(directory), num_speculative_tokens=3, **ALWAYS)
    llm = eager(directory, speculative_config=spec, async_scheduling=async_scheduling)
    engine = llm.engine
    prompt = spec_prompts(hf_model.config.vocab_size, seed=5)[0]
    want = _hf(hf_model, [prompt], 9)[0]
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    request = engine.scheduler.requests["r"]
    seen, lag = [], []
    while engine.has_unfinished_requests():
        outs = engine.step()
        delivered = outs[0].outputs[0].token_ids if outs else seen
        lag.append(len(request.output_token_ids) - len(delivered))
        seen = delivered
    assert seen == want
    if async_scheduling:
        assert max(lag) > 0  # the scheduler holds a verified step's tokens a call early
    else:
        assert lag[1:] == [0] * (len(lag) - 1)


def test_n2_penalties_min_tokens_and_logprobs_equal_non_speculative(llama):
    directory, hf_model = llama
    prompts = spec_prompts(hf_model.config.vocab_size, seed=5)
    spec = dict(method="draft_model", model=str(directory), num_speculative_tokens=3, **ALWAYS)
    plain, fast = eager(directory), eager(directory, speculative_config=spec)
    cases = [
        SamplingParams(n=2, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, repetition_penalty=1.5),
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, frequency_penalty=0.8),
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=6, logprobs=3),
    ]
    for params in cases:
        want, got = plain.generate(prompts, params), fast.generate(prompts, params)
        for a, b in zip(want, got, strict=True):
            for x, y in zip(a.outputs, b.outputs, strict=True):
                assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
                if params.logprobs:
                    assert [e.token_id for e in x.logprobs] == [e.token_id for e in y.logprobs]
                    for e, f in zip(x.logprobs, y.logprobs, strict=True):
                        assert e.logprob == pytest.approx(f.logprob, abs=1e-4)
                        assert [t for t, _ in e.top] == [t for t, _ in f.top]
    assert fast.engine.stats().spec_num_accepted_tokens > 0


def test_seeded_sampling_is_reproducible_and_low_acceptance_stops_proposing(llama, draft_dir):
    directory, hf_model = llama
    prompts = spec_prompts(hf_model.config.vocab_size, seed=6)
    params = SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=12, ignore_eos=True)
    cutoff = dict(min_acceptance_rate=0.5, acceptance_window=6, adaptive=False)
    for draft in (directory, draft_dir):
        runs = []
        for _ in range(2):
            spec = dict(method="draft_model", model=str(draft), num_speculative_tokens=3, **cutoff)
            llm = eager(directory, speculative_config=spec)
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert runs[0] == runs[1]
    # The other model's drafts are mostly rejected: each request stops proposing once the
    # target has judged 6 of its drafts (one a verification when none is accepted).
    stats = llm.engine.stats()
    assert stats.spec_num_drafts <= 6 * len(prompts) and stats.spec_num_accepted_tokens < 8
    assert not llm.engine.scheduler.speculating()


class _CyclingPolicy(SpeculationPolicy):
    """k = 0, 1, ..., max, 0, ... step after step, whatever the costs: every switch between
    proposing and not (asynchronous steps again) and between draft lengths is exercised."""

    def choose(self, num_tokens: int, num_rows: int, num_drafting: int) -> Choice:
        self.turn = getattr(self, "turn", -1) + 1
        self.seen = getattr(self, "seen", set()) | {self.turn % (self.max_k + 1)}
        return Choice(self.turn % (self.max_k + 1), 0.0)


def test_k_chosen_per_step_keeps_greedy_exact(llama):
    """The adaptive policy (the default) and a policy cycling k through 0..4 a step, with
    n-gram and with the target as its own draft (every draft accepted): greedy tokens equal
    the plain engine's, and the cycling run took every k."""
    directory, hf_model = llama
    prompts = spec_prompts(hf_model.config.vocab_size, seed=8)
    want = _plain(directory, prompts)
    ngram = dict(NGRAM, num_speculative_tokens=4, min_acceptance_rate=0.0)
    self_draft = dict(method="draft_model", model=str(directory), num_speculative_tokens=4)
    for spec in (ngram, self_draft):
        adaptive = eager(directory, speculative_config=spec)
        assert adaptive.engine.spec_policy is not None
        _assert_greedy_as_hf(adaptive, prompts, want)
        cycling = eager(directory, speculative_config=spec)
        cycling.engine.spec_policy = policy = _CyclingPolicy(4)
        _assert_greedy_as_hf(cycling, prompts, want)
        assert policy.seen == {0, 1, 2, 3, 4}


def test_the_policy_times_calls_that_landed_one_step(llama):
    """k cycling 0..4 switches between asynchronous steps and verified ones every call: a
    call that lands two steps (the one ahead, then its own) or none (its own left in flight)
    is not a step's cost; the policy times only calls that landed one."""
    directory, hf_model = llama
    spec = dict(method="draft_model", model=str(directory), num_speculative_tokens=4)
    llm = eager(directory, speculative_config=spec)
    engine = llm.engine
    engine.spec_policy = policy = _CyclingPolicy(4)
    landed, timed = [0], []
    collect, observe = engine.runner.collect, policy.observe_step

    def counting(flight):
        landed[0] += 1
        return collect(flight)

    def recording(num_tokens, seconds, drafted, overlapped=True):
        timed.append((landed[0], seconds > 0))
        observe(num_tokens, seconds, drafted, overlapped)

    engine.runner.collect, policy.observe_step = counting, recording
    prompts = spec_prompts(hf_model.config.vocab_size, seed=9)[:3]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        landed[0] = 0
        engine.step()
    assert {n for n, _ in timed} == {0, 1, 2}
    assert all(was_timed == (n == 1) for n, was_timed in timed)


@pytest.fixture(scope="module")
def byte_llama(tmp_path_factory):
    """A tiny Llama of 300 tokens with a byte-level BPE tokenizer: text, stop strings and
    grammars work on it."""
    import transformers

    from compile_engine.benchmarks.structured import add_byte_level_tokenizer

    directory = tmp_path_factory.mktemp("byte-llama")
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        eos_token_id=299,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    add_byte_level_tokenizer(directory)
    return directory


def test_a_stop_string_inside_accepted_drafts_drops_the_tokens_after_it(byte_llama):
    """The model as its own draft (runs of five tokens a step): a stop string taken from the
    middle of its plain output ends the speculative output at the same token, with the same
    text, though the step accepted tokens past it."""
    tmp_path = byte_llama
    spec = dict(method="draft_model", model=str(tmp_path), num_speculative_tokens=4, **ALWAYS)
    plain, fast = eager(tmp_path), eager(tmp_path, speculative_config=spec)
    prompts = ["abc abc abc", "hello world", "xyz"]
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    texts = [o.outputs[0].text for o in plain.generate(prompts, free)]
    for prompt, text in zip(prompts, texts, strict=True):
        middle = len(text) // 2
        stop = text[middle : middle + 2]
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
        (a,) = plain.generate(prompt, params)[0].outputs
        (b,) = fast.generate(prompt, params)[0].outputs
        assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (
            b.text,
            b.token_ids,
            b.finish_reason,
            b.stop_reason,
        )
        assert b.finish_reason == "stop" and len(b.token_ids) < 30
    stats = fast.engine.stats()
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0


def test_grammars_mask_every_verified_position(byte_llama):
    """Constrained requests speculate too: n-gram drafts cut to what the grammar accepts, a
    mask a verified row. Greedy tokens equal non-speculative decoding's; seeded sampled ones
    (another random stream than without speculation) keep to the grammar."""
    import json
    import re

    spec = dict(NGRAM, num_speculative_tokens=4, **ALWAYS)
    plain, fast = eager(byte_llama), eager(byte_llama, speculative_config=spec)
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"enum": ["xy", "zw"]}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    constraints = [{"regex": "(ab|cd){3,8}e"}, {"json": schema}, {"choice": ["alpha", "beta"]}]
    valid = [
        lambda t: re.fullmatch("(ab|cd){3,8}e", t),
        lambda t: set(json.loads(t)) == {"a", "b"},
        lambda t: t in ("alpha", "beta"),
    ]
    prompts = ["abab", '{"a": 1', "choose"]
    for temperature in (0.0, 0.7):
        params = [
            SamplingParams(temperature=temperature, seed=3, max_tokens=60, structured_outputs=c)
            for c in constraints
        ]
        want, got = plain.generate(prompts, params), fast.generate(prompts, params)
        for a, b, ok in zip(want, got, valid, strict=True):
            a, b = a.outputs[0], b.outputs[0]
            if temperature == 0.0:
                assert (a.token_ids, a.text, a.finish_reason) == (
                    b.token_ids,
                    b.text,
                    b.finish_reason,
                )
            if b.finish_reason == "stop":
                assert ok(b.text), b.text
    assert fast.engine.stats().spec_num_accepted_tokens > 0


def test_metrics_use_vllms_spec_decode_names():
    from compile_engine.runtime.metrics import ServerMetrics
    from compile_engine.runtime.scheduler import SchedulerStats

    stats = SchedulerStats(1, 0, 0.1, 0, 0, 0, 5, 15, 9, [5, 3, 1])
    text = ServerMetrics("m", lambda: stats, lambda: None).render().decode()
    for line in (
        'compile_engine:spec_decode_num_drafts_total{model_name="m"} 5.0',
        'compile_engine:spec_decode_num_draft_tokens_total{model_name="m"} 15.0',
        'compile_engine:spec_decode_num_accepted_tokens_total{model_name="m"} 9.0',
        'compile_engine:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"}'
        " 1.0",
    ):
        assert line in text
    off = SchedulerStats(1, 0, 0.1, 0, 0, 0)
    assert "spec_decode" not in ServerMetrics("m", lambda: off, lambda: None).render().decode()


def test_bench_latency_reports_the_mean_acceptance_length(llama, tmp_path):
    import json

    from compile_engine.benchmarks import latency

    directory, _ = llama
    # Fixed k: the adaptive policy rightly finds that a draft as large as the target, run
    # eagerly, does not pay on this CPU, and would propose nothing.
    spec = {"method": "draft_model", "model": str(directory), "num_speculative_tokens": 3}
    spec["adaptive"] = False
    argv = ["--model", str(directory), "--target", "cpu", "--dtype", "float32", "--enforce-eager"]
    argv += ["--batch-sizes", "2", "--input-len", "5", "--output-len", "9", "--num-iters", "1"]
    argv += ["--copy-rate", "1e10", "--results-dir", str(tmp_path)]
    assert latency.main([*argv, "--speculative-config", json.dumps(spec)]) == 0
    (record,) = tmp_path.glob("*.json")
    data = json.loads(record.read_text())
    # Its own draft: every draft accepted, 4 tokens a verifying row.
    assert data["batches"]["2"]["mean_acceptance_length"] == pytest.approx(4.0)
    assert data["engine"]["speculative_config"]["num_speculative_tokens"] == 3


# -- SmolLM2 ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_greedy_and_a_stop_string_with_ngram(smollm2_llm):
    """Greedy tokens equal the plain engine's on a repetitive answer that n-gram drafts
    speed up, up to a stop string (grammars: test_grammars_mask_every_verified_position). The
    speculative engine is built around the session engine's model, not a second load."""
    from compile_engine.runtime.engine import LLMEngine

    ngram = dict(NGRAM, prompt_lookup_max=4, num_speculative_tokens=4, **ALWAYS)
    config = EngineConfig(
        "smollm2-135m",
        dtype="float32",
        target="cpu",
        num_kv_blocks=64,
        enforce_eager=True,
        speculative_config=ngram,
    )
    engine = LLMEngine(config, loaded=smollm2_llm.engine.loaded)
    conv = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    params = SamplingParams(temperature=0, max_tokens=24, stop=["4. 4"])
    (a,) = smollm2_llm.chat(conv, params)[0].outputs
    engine.add_request("spec", smollm2_llm.apply_chat_template(conv), params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    (b,) = outs[-1].outputs
    assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (
        b.text,
        b.token_ids,
        b.finish_reason,
        b.stop_reason,
    )
    assert b.stop_reason == "4. 4" and len(b.token_ids) > 8
    assert engine.stats().spec_num_accepted_tokens > 0


def test_bench_speculative_replays_and_the_replay_is_no_users_method(llama, tmp_path):
    """`bench speculative --replay`: the benchmark-only replay proposer's all-accepted and
    none-accepted runs beside the plain engine's, its keys, and its tokens equal the plain
    engine's; `replay` is no speculative_config method (LLM and the server refuse it)."""
    import json

    from compile_engine.benchmarks import speculative

    directory, _ = llama
    argv = ["--model", str(directory), "--target", "cpu", "--dtype", "float32", "--enforce-eager"]
    argv += ["--replay", "--batch-sizes", "1,2", "--input-len", "5", "--output-len", "12"]
    argv += ["--rounds", "1", "--results-dir", str(tmp_path), "--profile", str(tmp_path / "p")]
    spec = dict(NGRAM, num_speculative_tokens=3, adaptive=False, min_acceptance_rate=0.0)
    assert speculative.main([*argv, "--speculative-config", json.dumps(spec)]) == 0
    profiles = sorted(p.name for p in (tmp_path / "p").iterdir())
    names = ("ceiling", "off", "zero")
    assert profiles == [f"profile-bs{b}-{n}.txt" for b in (1, 2) for n in names]
    assert "function calls" in (tmp_path / "p" / "profile-bs1-ceiling.txt").read_text()
    (record,) = tmp_path.glob("speculative-replay-*.json")
    data = json.loads(record.read_text())
    assert data["spec_ceiling_mean_acceptance_length_bs1_k3"] == pytest.approx(4.0, abs=0.5)
    assert data["batches"]["2"]["zero"]["mean_acceptance_length"] == 1.0
    assert {"spec_ceiling_speedup_bs2_k3", "spec_zero_accept_cost_bs1"} <= set(data)
    assert "benchmark-only" in data["proposers"]["ceiling"]
    for b in ("1", "2"):
        assert data["batches"][b]["ceiling"]["outputs_differ"] == 0
        assert data["batches"][b]["zero"]["outputs_differ"] == 0
    items = speculative.load_workload()
    assert len(items) >= 12 and {it["kind"] for it in items} == {
        "rewrite",
        "summarise",
        "code-edit",
    }
    with pytest.raises(EngineConfigError, match="method='replay' is not supported"):
        EngineConfig("x", target="cpu", speculative_config=dict(NGRAM, method="replay"))
