"""The choice of k a step (runtime/spec_policy.py) from given step costs and acceptances: the
k it picks maximizes expected tokens per second, 0 when drafts do not pay (low acceptance, or
a step whose cost grows with its tokens), probes spaced by their cost, and estimates that
follow a change. Torch-free and fast; the engine's use of it is in test_speculative.py."""

from __future__ import annotations

import pytest

from compile_engine.runtime.spec_policy import Acceptance, SpeculationPolicy, StepCosts, token_bin


def timed(policy: SpeculationPolicy, cost, counts) -> None:
    """Steps at each token count in `counts`, costing cost(T) seconds."""
    for t in counts:
        for _ in range(3):
            policy.observe_step(t, cost(t), drafted=False)


def accepting(policy: SpeculationPolicy, rate: float, rows: int = 400) -> None:
    """Rows that proposed k drafts and had each accepted with probability `rate` (given the
    ones before were): the expected counts, deterministically."""
    k = policy.max_k
    policy.observe_step(0, 0.0, drafted=True)  # a step that verified drafts (not timed)
    for _ in range(rows):
        policy.observe_proposal(k, k)
    acc = policy.acceptance
    for i in range(k):
        offered = rows * rate**i
        acc.offered[i] += offered
        acc.accepted[i] += offered * rate


def test_token_bins_are_exact_then_geometric():
    assert [token_bin(t) for t in (1, 5, 32)] == [1, 5, 32]
    bins = {token_bin(t) for t in range(33, 2049)}
    assert len(bins) < 40 and all(abs(token_bin(t) - t) / t < 0.13 for t in range(33, 2049))


def observed(costs: StepCosts, num_tokens: int, seconds: float) -> None:
    """A count's first step (not kept: its first-use costs) and one timed step."""
    costs.observe(num_tokens, 10 * seconds)
    costs.observe(num_tokens, seconds)


def test_step_costs_are_medians_and_optimistic_where_not_timed():
    costs = StepCosts()
    assert costs.estimate(4) is None
    observed(costs, 2, 0.010)
    assert costs.estimate(9) == costs.estimate(1) == pytest.approx(0.010)
    observed(costs, 9, 0.018)
    assert costs.estimate(5) == pytest.approx(0.010)  # not timed: the nearest below
    assert costs.estimate(9) == costs.estimate(17) == pytest.approx(0.018)
    observed(costs, 3, 0.012)
    assert costs.estimate(2.25) == pytest.approx(0.0105)  # a mixture of 2 and 3
    # The median of the window: one stall does not move it.
    for seconds in (0.010, 0.010, 3.0):
        costs.observe(2, seconds)
    assert costs.estimate(2) == pytest.approx(0.010)


def test_full_acceptance_at_flat_cost_takes_every_draft():
    policy = SpeculationPolicy(4)
    timed(policy, lambda t: 0.004 * (1 + 0.01 * t), [1, 2, 3, 4, 5])
    accepting(policy, 1.0)
    choice = policy.choose(num_tokens=1, num_rows=1, num_drafting=1)
    assert choice.k == 4 and not choice.probe
    # Expected: 5 tokens in a step of 5 tokens' cost.
    assert choice.tokens_per_s == pytest.approx(5 / (0.004 * 1.05), rel=0.02)


def test_no_acceptance_takes_none():
    policy = SpeculationPolicy(4)
    timed(policy, lambda t: 0.004 * (1 + 0.01 * t), [1, 2, 3, 4, 5])
    accepting(policy, 0.0)
    assert policy.choose(1, 1, 1).k == 0


def test_the_k_that_maximizes_tokens_per_second():
    """Acceptance 0.7 a position; a step costs 10 ms + 0.5 ms a token at batch 8: each k's
    rate computed by hand, the policy's the best of them (2: neither end)."""
    policy = SpeculationPolicy(4)
    cost = lambda t: 0.010 + 0.0005 * t  # noqa: E731
    timed(policy, cost, range(8, 41))
    accepting(policy, 0.7, rows=10_000)  # the prior's pull is negligible
    by_hand = []
    for k in range(5):
        accepted = sum(0.7**i for i in range(1, k + 1))
        by_hand.append((8 + 8 * accepted) / cost(8 + 8 * k))
    assert policy.choose(8, 8, 8).k == max(range(5), key=by_hand.__getitem__) == 2


def test_a_large_batch_whose_step_grows_with_tokens_takes_none():
    """At batch 256 a step's cost is proportional to its tokens (compute-bound): even at 0.7
    acceptance no k emits more tokens a second than none."""
    policy = SpeculationPolicy(4)
    timed(policy, lambda t: 1e-5 * t, [256, 512, 768, 1024, 1280])
    accepting(policy, 0.7)
    assert policy.choose(256, 256, 256).k == 0


def test_unknown_sizes_are_timed_without_drafts_first():
    policy = SpeculationPolicy(4)
    assert policy.choose(1, 1, 1).k == 0  # nothing timed: a plain step first
    policy.observe_step(1, 0.004, drafted=False)
    assert not policy.known(1)  # a count's first step is not kept (first-use costs)
    policy.observe_step(1, 0.004, drafted=False)
    # Optimistic where not timed (a larger count costs what the nearest timed one does):
    # every k is judged, so the largest is tried at once.
    assert policy.choose(1, 1, 1).k == 4
    # Timed dear, it gives way to the next best not yet known, and so on down.
    for _ in range(2):
        policy.observe_step(5, 0.040, drafted=True, overlapped=False)
    assert policy.choose(1, 1, 1).k == 3
    assert policy.choose(3, 3, 0).k == 0  # nobody can draft


def test_one_drafting_row_is_costed_over_its_draft_count():
    """SmolLM2 on the H200 (c7aa8bd's record): a 1-token step 0.85 ms overlapped and 1.2 ms
    not, 2-7 tokens ~1.75 ms, proposals found 52% of the time. At batch 1 a step has no
    draft or six: its expected time is 0.48 * 1.2 + 0.52 * 1.75 ms, and k = 6 wins; priced
    at its mean count (4.1 tokens: 1.75 ms) every k lost to plain decode."""
    policy = SpeculationPolicy(6)
    for _ in range(3):
        policy.observe_step(1, 0.00085, drafted=False)
        policy.observe_step(1, 0.0012, drafted=False, overlapped=False)
        for t in range(2, 8):
            policy.observe_step(t, 0.00175, drafted=True, overlapped=False)
    acc = policy.acceptance
    rates = [0.54, 0.85, 0.75, 0.68, 0.63, 0.74]
    rows = 10_000  # the priors' pull is negligible
    survive = 1.0
    for i, rate in enumerate(rates):
        acc.asked[i], acc.proposed[i] = rows, 0.52 * rows
        acc.offered[i], acc.accepted[i] = rows * survive, rows * survive * rate
        survive *= rate
    choice = policy.choose(1, 1, 1)
    accepted, survive = 0.0, 1.0
    for rate in rates:
        survive *= rate
        accepted += 0.52 * survive
    by_hand = (1 + accepted) / (0.48 * 0.0012 + 0.52 * 0.00175)
    assert choice.k == 6 and choice.tokens_per_s == pytest.approx(by_hand, rel=1e-3)
    assert by_hand > 1 / 0.00085  # faster than plain decode
    assert (1 + accepted) / 0.00175 < 1 / 0.00085  # which the mean count's time hid


def test_a_first_step_stall_does_not_price_a_k_out():
    """Each size's first step 100x slower (a lazy compile at first use): the policy still
    climbs to every draft at full acceptance; kept, that one sample priced k >= 1 out, and a
    size no longer chosen is never timed again."""
    policy = SpeculationPolicy(4)
    accepting(policy, 1.0)
    seen: set[int] = set()
    for _ in range(8):  # plain steps first (prefill, nothing to propose): one size well timed
        policy.observe_step(1, 0.4 if 1 not in seen else 0.004, drafted=False)
        seen.add(1)
    for _ in range(12):
        choice = policy.choose(1, 1, 1)
        tokens = 1 + choice.k
        policy.observe_step(tokens, 0.4 if tokens not in seen else 0.004, drafted=choice.k > 0)
        seen.add(tokens)
    assert policy.choose(1, 1, 1).k == 4


def test_a_cheap_probe_is_still_spaced_by_the_floor():
    policy = SpeculationPolicy(4, probe_budget=0.01)
    timed(policy, lambda t: 0.004 * (1 + 0.002 * (t - 1)), [1, 2])
    assert policy.probe_interval(1, 1) == 8


def test_probes_are_spaced_by_their_cost_and_follow_a_change():
    policy = SpeculationPolicy(4, probe_budget=0.01)
    cost = lambda t: 0.004 * (1 + 0.05 * (t - 1))  # noqa: E731  a k=1 step costs 5% more
    timed(policy, cost, [1, 2, 3, 4, 5])
    accepting(policy, 0.0)
    # 5% more, counted twice (the step before a probe loses its overlap): 10 steps of 1%
    # (11 where float rounding lands just above).
    interval = policy.probe_interval(1, 1)
    assert interval in (10, 11)
    steps = 0
    while not policy.choose(1, 1, 1).probe:
        policy.observe_step(1, cost(1), drafted=False)
        steps += 1
    assert steps == interval
    # The drafts start being accepted: some probes later every draft is taken again.
    for _ in range(200):
        choice = policy.choose(1, 1, 1)
        if choice.k:
            policy.observe_proposal(choice.k, choice.k)
            policy.observe_verified(choice.k, choice.k)
        policy.observe_step(1 + choice.k, cost(1 + choice.k), drafted=bool(choice.k))
    assert policy.choose(1, 1, 1).k == 4


def test_acceptance_counts_positions_after_accepted_ones():
    acc = Acceptance(4, prior_weight=0.0)
    acc.observe_verified(4, 1)  # draft 1 accepted, 2 rejected, 3 and 4 never judged
    acc.observe_verified(2, 2)  # both accepted
    acc.observe_proposal(4, 2)
    p, a = acc.rates()
    assert acc.offered == [2, 2, 0, 0] and acc.accepted == [2, 1, 0, 0]
    assert a[:2] == [1.0, 0.5] and p[:3] == [1.0, 1.0, 0.0]
