"""The sampler against plain per-row references written with numpy in float64."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from compile_engine.runtime.sampler import (
    Sampler,
    SamplingBatch,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
)
from compile_engine.runtime.sampling_params import SamplingParams

V = 32


def make_batch(
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    eos: tuple[int, ...] = (),
    vocab_size: int = V,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
        vocab_size,
        "cpu",
        eos_token_ids=eos,
    )


def softmax64(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def ref_top_k(row: np.ndarray, k: int) -> np.ndarray:
    """Keep mask: every token at least as large as the k-th largest."""
    if k <= 0 or k >= len(row):
        return np.ones(len(row), bool)
    kth = np.sort(row)[::-1][k - 1]
    return row >= kth


def ref_top_p(row: np.ndarray, p: float) -> tuple[np.ndarray, float]:
    """Keep mask, plus how close any cumulative mass came to p (to skip ambiguous cases)."""
    probs = softmax64(row)
    order = np.argsort(-probs, kind="stable")
    mass = 0.0
    closest = math.inf
    threshold = probs[order[0]]
    for i in order:
        if mass >= p:
            break
        threshold = probs[i]
        mass += probs[i]
        closest = min(closest, abs(mass - p))
    return probs >= threshold * (1 - 1e-9), closest


def kept(logits: torch.Tensor) -> np.ndarray:
    return torch.isfinite(logits).numpy()


# --- masks -------------------------------------------------------------------------------


def test_top_k_keeps_ties_at_the_boundary() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]])
    apply_top_k_top_p(logits, torch.tensor([[2]]), None)
    # The 2nd largest value is 2.0, held by three tokens: all of them stay.
    assert kept(logits).tolist() == [[True, False, True, True, True, False]]


@pytest.mark.parametrize("seed", range(20))
def test_top_k_matches_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    # Small integers make ties common.
    logits = torch.randint(-4, 5, (8, V), generator=gen).float()
    ks = torch.randint(1, V + 1, (8, 1), generator=gen)
    out = logits.clone()
    apply_top_k_top_p(out, ks, None)
    for r in range(8):
        np.testing.assert_array_equal(kept(out[r]), ref_top_k(logits[r].numpy(), int(ks[r])))
        assert torch.equal(out[r][kept(out[r])], logits[r][kept(out[r])])


@pytest.mark.parametrize("seed", range(30))
def test_top_p_and_top_k_then_top_p_match_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows = 8
    logits = torch.randint(-6, 7, (rows, V), generator=gen).float() / 2
    ps = torch.rand(rows, 1, generator=gen) * 0.98 + 0.01
    ks = torch.randint(1, V + 1, (rows, 1), generator=gen)
    for top_k in (None, ks):
        out = logits.clone()
        apply_top_k_top_p(out, top_k, ps)
        for r in range(rows):
            row = logits[r].double().numpy()
            if top_k is not None:
                row = np.where(ref_top_k(row, int(ks[r])), row, -np.inf)
            expected, closest = ref_top_p(row, float(ps[r]))
            if closest < 1e-5:  # float32 cumsum cannot decide this boundary reliably
                continue
            np.testing.assert_array_equal(kept(out[r]), expected, err_msg=f"row {r}")


def test_top_p_keeps_the_top_token_and_ties_at_the_boundary() -> None:
    # probs ~ [0.4, 0.2, 0.2, 0.2]: top_p 0.5 needs the first two; the tie keeps all three.
    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2], [0.9, 0.05, 0.03, 0.02]]))
    apply_top_k_top_p(logits, None, torch.tensor([[0.5], [0.01]]))
    assert kept(logits).tolist() == [[True, True, True, True], [True, False, False, False]]


def test_top_p_that_rounds_to_zero_in_float32_keeps_the_top_token() -> None:
    # 2.2e-313 > 0 passes the API's check but is 0.0 as float32 (the fuzz test's find): the
    # nucleus then held no token and the gather read index -1.
    params = [SamplingParams(temperature=1.0, top_p=2.2250738585e-313, seed=1)]
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.2, 0.1]]))
    out = Sampler()(logits, make_batch(params, vocab_size=4))
    assert out.token_ids.tolist() == [1]


@pytest.mark.parametrize("temperature", [2.2250738585e-313, 1e-40, 1e-6])
def test_a_temperature_too_small_for_float32_samples_greedily(temperature: float) -> None:
    # logits / temperature overflowed to inf (or divided by a float32 0): NaN probabilities,
    # and the race then picked token 0 instead of the most likely one.
    params = [SamplingParams(temperature=temperature, seed=1)]
    assert params[0].greedy
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.2, 0.1]]))
    assert Sampler()(logits, make_batch(params, vocab_size=4)).token_ids.tolist() == [1]


@pytest.mark.parametrize(
    "field", [{"temperature": float("nan")}, {"temperature": float("inf")},
              {"repetition_penalty": float("nan")}, {"repetition_penalty": float("inf")}],
)  # fmt: skip
def test_non_finite_temperature_and_repetition_penalty_are_refused(field: dict) -> None:
    # NaN passed the range checks (every comparison with NaN is false) and sampled token 0.
    from compile_engine.runtime.sampling_params import InvalidSamplingParams

    with pytest.raises(InvalidSamplingParams, match="finite"):
        SamplingParams(**field)


def test_min_p_matches_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(16, V, generator=gen) * 2, dim=-1)
    min_p = torch.rand(16, 1, generator=gen)
    out = probs.clone()
    apply_min_p(out, min_p)
    for r in range(16):
        p = probs[r].double().numpy()
        expected = p >= float(min_p[r]) * p.max()
        np.testing.assert_array_equal(out[r].numpy() > 0, expected)


# --- penalties and min_tokens ----------------------------------------------------------


def test_penalties_match_hand_computed_values() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = SamplingParams(
        temperature=0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    batch = make_batch([params], outputs=[[2, 2, 3]], prompts=[[1, 5]], vocab_size=6)
    out = logits.clone()
    apply_penalties(out, batch)
    expected = [
        2.0,  # unseen
        -1.0 * 2.0,  # prompt token, negative: multiplied
        0.5 / 2.0 - 0.5 * 2 - 0.25,  # output twice: repetition, frequency 2x, presence
        3.0 / 2.0 - 0.5 * 1 - 0.25,  # output once
        -2.0,  # unseen
        1.0 / 2.0,  # prompt token, positive: divided; no output so no frequency/presence
    ]
    torch.testing.assert_close(out[0], torch.tensor(expected))


def test_penalties_change_greedy_choice_and_only_on_their_row() -> None:
    logits = torch.tensor([[5.0, 4.9, 0.0, 0.0]] * 2)
    params = [SamplingParams(temperature=0, presence_penalty=1.0), SamplingParams(temperature=0)]
    batch = make_batch(params, outputs=[[0], [0]], vocab_size=4)
    assert Sampler()(logits, batch).token_ids.tolist() == [1, 0]


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached() -> None:
    logits = torch.tensor([[9.0, 8.0, 7.0, 1.0]] * 3)
    params = [
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1]),
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1], ignore_eos=True),
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1]),
    ]
    # eos is 0. Rows 0 and 1 have one output, row 2 already has two.
    batch = make_batch(params, outputs=[[3], [3], [3, 3]], eos=(0,), vocab_size=4)
    assert Sampler()(logits, batch).token_ids.tolist() == [2, 0, 0]


# --- greedy, logprobs ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = torch.randn(7, V, generator=torch.Generator().manual_seed(1)).to(dtype)
    batch = make_batch([SamplingParams(temperature=0)] * 7)
    assert batch.all_greedy and not batch.needs_processing
    out = Sampler()(logits, batch)
    assert out.token_ids.dtype == torch.long
    assert torch.equal(out.token_ids, logits.float().argmax(dim=-1))
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_takes_the_first_of_tied_maxima_and_nan_as_argmax_does() -> None:
    # The CPU path reduces with max(dim).indices (3x argmax's speed there): the same index as
    # argmax on ties, on NaN and on rows of -inf, in float32 and bfloat16.
    from compile_engine.runtime.sampler import greedy_argmax

    logits = torch.zeros(5, V)
    logits[0, 3] = logits[0, 7] = 5.0
    logits[1, 2], logits[1, 5] = float("nan"), 9.0
    logits[2] = -float("inf")
    logits[3, 1] = logits[3, 4] = float("nan")
    logits[4] = torch.randn(V, generator=torch.Generator().manual_seed(4))
    for dtype in (torch.float32, torch.bfloat16):
        rows = logits.to(dtype)
        want = [3, 2, 0, 1, int(rows[4].argmax())]
        assert greedy_argmax(rows).tolist() == rows.argmax(dim=-1).tolist() == want


def test_mixed_batch_greedy_rows_stay_argmax() -> None:
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0 if i % 2 else 1.5, top_p=0.9) for i in range(6)]
    out = Sampler()(logits, make_batch(params))
    assert torch.equal(out.token_ids[1::2], logits[1::2].argmax(dim=-1))


def test_logprobs_are_raw_log_softmax_with_max_k() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3)).bfloat16()
    params = [
        SamplingParams(temperature=0.7, logprobs=2, repetition_penalty=1.5),
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(temperature=1.0),
    ]
    out = Sampler()(logits, make_batch(params, outputs=[[1, 2], [], [4]]))
    reference = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs.shape == (3,) and out.logprobs.dtype == torch.float32
    assert out.top_logprobs.shape == (3, 5) and out.top_logprob_ids.shape == (3, 5)
    torch.testing.assert_close(out.logprobs, reference.gather(1, out.token_ids[:, None])[:, 0])
    values, ids = reference.topk(5, dim=-1)
    assert torch.equal(out.top_logprob_ids, ids)
    torch.testing.assert_close(out.top_logprobs, values)


def test_logprobs_zero_gives_only_the_chosen_token() -> None:
    logits = torch.randn(2, V)
    out = Sampler()(logits, make_batch([SamplingParams(temperature=0, logprobs=0)] * 2))
    assert out.top_logprobs.shape == (2, 0)
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits, -1).max(dim=-1).values)


# --- randomness ---------------------------------------------------------------------------


def test_seeded_row_ignores_batch_composition_and_order() -> None:
    gen = torch.Generator().manual_seed(4)
    target = torch.randn(V, generator=gen)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=7)

    def run(position: int, others: int, other_params: SamplingParams) -> list[int]:
        generator = torch.Generator().manual_seed(seeded.seed)
        tokens = []
        for _ in range(20):
            logits = torch.randn(others + 1, V, generator=gen) * 3
            logits[position] = target
            params = [other_params] * (others + 1)
            params[position] = seeded
            gens: list[torch.Generator | None] = [None] * (others + 1)
            gens[position] = generator
            out = Sampler()(logits, make_batch(params, generators=gens))
            tokens.append(int(out.token_ids[position]))
        return tokens

    alone = run(0, 0, seeded)
    assert len(set(alone)) > 1  # it really samples
    assert run(3, 5, SamplingParams(temperature=0.5, top_k=3)) == alone
    assert run(1, 2, SamplingParams(temperature=0)) == alone
    other_seed = SamplingParams(temperature=1.0, seed=99)  # gets None generators here: fine
    assert run(0, 7, other_seed) == alone


def frequencies(params: SamplingParams, logits: torch.Tensor, draws: int) -> np.ndarray:
    torch.manual_seed(1234)
    batch = make_batch([params] * draws, vocab_size=logits.numel())
    out = Sampler()(logits.expand(draws, -1), batch)
    return np.bincount(out.token_ids.numpy(), minlength=logits.numel()) / draws


def assert_close_to(observed: np.ndarray, expected: np.ndarray, draws: int) -> None:
    # 5 standard deviations of a binomial frequency per token; zero-probability tokens never.
    sigma = np.sqrt(expected * (1 - expected) / draws)
    assert np.all(np.abs(observed - expected) <= 5 * sigma + 1e-12), (observed, expected)
    assert np.all(observed[expected == 0] == 0)


def test_temperature_sampling_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    draws = 40000
    observed = frequencies(SamplingParams(temperature=0.7), logits, draws)
    assert_close_to(observed, softmax64(logits.double().numpy() / 0.7), draws)


def test_top_p_and_min_p_sampling_distribution() -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -2.0])
    draws = 40000
    scaled = logits.double().numpy() / 1.3
    probs = softmax64(scaled)
    keep, _ = ref_top_p(scaled, 0.8)
    expected = np.where(keep, probs, 0) / probs[keep].sum()
    observed = frequencies(SamplingParams(temperature=1.3, top_p=0.8), logits, draws)
    assert_close_to(observed, expected, draws)

    keep = probs >= 0.3 * probs.max()
    expected = np.where(keep, probs, 0) / probs[keep].sum()
    observed = frequencies(SamplingParams(temperature=1.3, min_p=0.3), logits, draws)
    assert_close_to(observed, expected, draws)


def test_build_flags_skip_unused_work() -> None:
    batch = make_batch([SamplingParams(temperature=0.8), SamplingParams(temperature=0)])
    assert not batch.all_greedy and not batch.needs_processing
    assert batch.top_k is batch.top_p is batch.min_p is batch.output_counts is None
    assert batch.max_num_logprobs is None and batch.any_unseeded
    batch = make_batch([SamplingParams(temperature=0, top_k=5, top_p=0.5)])
    assert batch.top_k is None and batch.top_p is None  # greedy rows ignore them
