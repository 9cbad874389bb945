"""How many drafts a step takes (issue 33, deliverable 3): k chosen per step, 0..
num_speculative_tokens, from measured step times and per-position acceptance, so that
speculation never makes a batch slower. Plain Python, no torch (STYLE #7).

A step with B decoding rows, D of them drafting with up to k drafts each, schedules about
B + D * drafted(k) tokens and emits about B + D * accepted(k):

    drafted(k)  = sum_{i<=k} p_i                    p_i: a row asked for >= i drafts got >= i
    accepted(k) = sum_{i<=k} p_i * prod_{j<=i} a_j  a_j: draft j accepted, the ones before were

The policy picks the k with the most expected tokens per second, tokens(k) over the step's
expected time, from the engine's measured step times at T scheduled tokens. Those are kept
apart for steps that overlapped the next one's host work (k = 0: asynchronous) and steps that
did not (k > 0: a proposal needs the last tokens on the host, so even a step whose proposer
found nothing waits for its own tokens). One drafting row (batch 1) has a bimodal step: no
draft found, or k of them; its expected time is over that distribution, not the time of its
mean count (on the H200 SmolLM2's 1-token step took 0.85 ms overlapped and 1.2 ms not, 2-7
tokens 1.7-1.8 ms: at a 52% proposal rate the mean count priced every k out). With more
drafting rows the step's count concentrates and its mean's time is used. That is the
trade-off vLLM's fixed k and its n-gram slowdown under load miss: at batch 1 on a GPU
verifying 5 tokens costs about what 1 does (the weights are read once either way), at batch
256 it does not, and at low acceptance no k pays. When k = 0 wins, the engine steps
asynchronously again (no proposal needs the last tokens on the host) and every
`probe_interval()` steps a k = 1 step refreshes the acceptance estimate, spaced so that probes
cost at most `probe_budget` of the time.

Estimates adapt: step times are the median of the last `window` steps at a token count
(exact counts up to 32, geometric bins above; the median because a CPU shared with other work
stalls a step now and then; the first step at a count is not kept: it pays first-use costs);
a count not timed yet costs what the nearest smaller one timed does (optimistic: a k that
could win is tried at each size until it is known, twice; every k is judged, so a step cost
that is flat past 2 tokens is found at the largest k at once), and a step without drafts is
timed at a size before any k is judged against it. Acceptance counts
decay by `decay` each step that verified drafts, from priors (proposals: all given;
acceptance: one half) worth `prior_weight` observations a position.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field

# Token counts up to this are timed exactly; above, in bins of this ratio (a batch-256
# verification step's count varies with each row's drafts).
_EXACT_TOKENS = 32
_BIN_RATIO = 1.125


def token_bin(num_tokens: int) -> int:
    """The representative count of the bin `num_tokens` is timed in."""
    if num_tokens <= _EXACT_TOKENS:
        return num_tokens
    index = math.floor(math.log(num_tokens / _EXACT_TOKENS, _BIN_RATIO))
    return round(_EXACT_TOKENS * _BIN_RATIO**index)


@dataclass(slots=True)
class StepCosts:
    """Step seconds by scheduled tokens: a windowed median per bin, interpolated. The first
    step of each bin is not kept: it pays first-use costs (lazy kernel loads and compiles,
    allocator growth, a graph's first replay) that later steps do not, and a bin is judged by
    its samples alone, so one such stall would price its k out for good (a size the policy
    stops choosing is never timed again). On the H200 the replay's every-draft-accepted run
    took drafts in its warm-up at 148 tok/s (k = 1 only, slower than no speculation) and then
    none for a whole round (163c9f7), which such a stall explains (not confirmed on the device
    yet: the record kept only the final medians, normal by then)."""

    window: int = 16
    _samples: dict[int, deque[float]] = field(default_factory=dict)
    _keys: list[int] = field(default_factory=list)  # sorted bins with samples
    _medians: dict[int, float] = field(default_factory=dict)  # computed since the last sample
    _seen: set[int] = field(default_factory=set)  # bins whose first step was observed

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or not seconds > 0:
            return
        key = token_bin(num_tokens)
        if key not in self._seen:
            self._seen.add(key)
            return
        samples = self._samples.get(key)
        if samples is None:
            samples = self._samples[key] = deque(maxlen=self.window)
            self._keys.insert(bisect_left(self._keys, key), key)
        samples.append(seconds)
        self._medians.pop(key, None)

    def known(self, num_tokens: float) -> bool:
        """Whether a step of this many tokens (the larger count of a mixture) was timed."""
        return token_bin(math.ceil(num_tokens)) in self._samples

    def timed_below(self, num_tokens: float) -> bool:
        """Whether a count at most this one was timed (its estimate is then no guess from a
        larger count)."""
        return bool(self._keys) and self._keys[0] <= token_bin(math.floor(num_tokens))

    def estimate(self, num_tokens: float) -> float | None:
        """Seconds a step of `num_tokens` takes; None before any step was timed. A count not
        timed yet is taken to cost what the nearest timed count below it does (the smallest
        timed, if none is below): optimistic, so that a k that could win is tried once at
        each size and then known."""
        keys = self._keys
        if not keys:
            return None
        low = math.floor(num_tokens)
        if low < num_tokens and low <= _EXACT_TOKENS:
            # An expected count between two exact ones (some rows drafting, some not): the
            # mixture's cost, linear between the two.
            share = num_tokens - low
            t_low, t_high = self.estimate(low), self.estimate(low + 1)
            return t_low + share * (t_high - t_low)
        key = token_bin(round(num_tokens))
        if key in self._samples:
            return self._median(key)
        i = bisect_left(keys, key)
        return self._median(keys[max(i - 1, 0)])

    def _median(self, key: int) -> float:
        median = self._medians.get(key)
        if median is None:
            values = sorted(self._samples[key])
            n = len(values)
            median = values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])
            self._medians[key] = median
        return median


@dataclass(slots=True)
class Acceptance:
    """Per-position proposal and acceptance rates, decayed counts (position i = index i - 1)."""

    k: int
    decay: float = 0.9
    prior_weight: float = 1.0
    asked: list[float] = field(init=False)  # rows that could take >= i drafts
    proposed: list[float] = field(init=False)  # ... and got >= i from the proposer
    offered: list[float] = field(init=False)  # rows verifying draft i, 1..i-1 accepted
    accepted: list[float] = field(init=False)  # ... and draft i accepted

    def __post_init__(self) -> None:
        self.asked, self.proposed = [0.0] * self.k, [0.0] * self.k
        self.offered, self.accepted = [0.0] * self.k, [0.0] * self.k

    def age(self) -> None:
        for counts in (self.asked, self.proposed, self.offered, self.accepted):
            for i in range(self.k):
                counts[i] *= self.decay

    def observe_proposal(self, room: int, num_drafts: int) -> None:
        """A row could take `room` drafts and the proposer gave `num_drafts`."""
        for i in range(min(room, self.k)):
            self.asked[i] += 1
            self.proposed[i] += i < num_drafts

    def observe_verified(self, num_drafts: int, num_accepted: int) -> None:
        """A row verified `num_drafts` drafts and the target accepted the first `num_accepted`."""
        for i in range(min(num_accepted + 1, num_drafts, self.k)):
            self.offered[i] += 1
            self.accepted[i] += i < num_accepted

    def rates(self) -> tuple[list[float], list[float]]:
        """(p_i, a_i) for i = 1..k, pulled by the prior toward 1 (a proposer gives what it
        is asked for until seen otherwise) and toward one half."""
        w = self.prior_weight

        def rate(hits: float, trials: float, prior: float) -> float:
            return (hits + prior * w) / (trials + w) if trials + w > 0 else prior

        p = [rate(self.proposed[i], self.asked[i], 1.0) for i in range(self.k)]
        for i in range(1, self.k):  # a row given i + 1 drafts was given i: never more likely
            p[i] = min(p[i], p[i - 1])
        a = [rate(self.accepted[i], self.offered[i], 0.5) for i in range(self.k)]
        return p, a


@dataclass(slots=True)
class Choice:
    k: int
    tokens_per_s: float  # the expected rate at k (0 when no step time is known yet)
    probe: bool = False  # k = 1 chosen to refresh the acceptance estimate


class SpeculationPolicy:
    """Chooses each step's k; the engine reports each step's tokens and time, each row's
    proposal and verification."""

    def __init__(
        self,
        num_speculative_tokens: int,
        *,
        window: int = 16,
        decay: float = 0.9,
        prior_weight: float = 1.0,
        probe_budget: float = 0.01,
        max_probe_interval: int = 256,
    ) -> None:
        self.max_k = num_speculative_tokens
        self.costs = StepCosts(window)  # steps that overlapped the next one's host work
        self.sync_costs = StepCosts(window)  # steps that did not
        self.acceptance = Acceptance(num_speculative_tokens, decay, prior_weight)
        self.probe_budget = probe_budget
        self.max_probe_interval = max_probe_interval
        self._steps_since_drafts = 0
        self.last: Choice | None = None
        self.chosen = [0] * (num_speculative_tokens + 1)  # steps per k chosen, for the record

    # -- what happened --------------------------------------------------------------------

    def observe_step(
        self, num_tokens: int, seconds: float, drafted: bool, overlapped: bool = True
    ) -> None:
        """One engine step: the tokens it scheduled, its wall time, whether rows verified
        drafts (the acceptance counts age by steps that taught them something), whether it
        overlapped the next step's host work (left in flight)."""
        (self.costs if overlapped else self.sync_costs).observe(num_tokens, seconds)
        if drafted:
            self._steps_since_drafts = 0
            self.acceptance.age()
        else:
            self._steps_since_drafts += 1

    def observe_proposal(self, room: int, num_drafts: int) -> None:
        self.acceptance.observe_proposal(room, num_drafts)

    def observe_verified(self, num_drafts: int, num_accepted: int) -> None:
        self.acceptance.observe_verified(num_drafts, num_accepted)

    # -- the choice -----------------------------------------------------------------------

    def expected(self, p: list[float], a: list[float]) -> list[tuple[float, float]]:
        """(drafted(k), accepted(k)) of one drafting row, for k = 0..num_speculative_tokens,
        from the proposal and acceptance rates (p_i, a_i: `Acceptance.rates`)."""
        table = [(0.0, 0.0)]
        drafted = accepted = 0.0
        survive = 1.0
        for i in range(self.max_k):
            survive *= a[i]
            drafted += p[i]
            accepted += p[i] * survive
            table.append((drafted, accepted))
        return table

    def seconds(self, num_tokens: float, overlapped: bool) -> float | None:
        """A step's estimated time from the table of its kind, the other's where that timed
        nothing at or below the count and the other did (optimistic either way: overlapped
        steps are the cheaper, and an untimed count costs what a smaller one did)."""
        first, other = (
            (self.costs, self.sync_costs) if overlapped else (self.sync_costs, self.costs)
        )
        if not first.timed_below(num_tokens) and other.timed_below(num_tokens):
            return other.estimate(num_tokens)
        estimate = first.estimate(num_tokens)
        return estimate if estimate is not None else other.estimate(num_tokens)

    def known(self, num_tokens: float) -> bool:
        return self.costs.known(num_tokens) or self.sync_costs.known(num_tokens)

    def step_seconds(
        self, num_tokens: int, num_drafting: int, proposed: list[float]
    ) -> list[float | None]:
        """Expected seconds of a step of `num_tokens` tokens before drafts with
        `num_drafting` rows asked for k drafts, for k = 0..max_k (`proposed`: p_1..p_max_k).
        One drafting row: over its draft count's distribution (j drafts with probability
        p_j - p_j+1); more: at the mean count."""
        out = [self.seconds(num_tokens, overlapped=True)]
        if num_drafting != 1:
            drafted = 0.0
            for p in proposed:
                drafted += p
                out.append(self.seconds(num_tokens + num_drafting * drafted, overlapped=False))
            return out
        at = [self.seconds(num_tokens + j, overlapped=False) or 0.0 for j in range(self.max_k + 1)]
        # E[t] at k: sum_j<k (p_j - p_j+1) t_j + p_k t_k, with p_0 = 1.
        below, previous = 0.0, 1.0
        for k, p in enumerate(proposed, 1):
            below += (previous - p) * at[k - 1]
            out.append(below + p * at[k])
            previous = p
        return out

    def choose(self, num_tokens: int, num_rows: int, num_drafting: int) -> Choice:
        """The k for a step of `num_tokens` tokens before drafts, `num_rows` sampling rows,
        `num_drafting` of which may take drafts."""
        if num_drafting <= 0 or self.max_k == 0 or not self.known(num_tokens):
            # A step without drafts at this size is timed first: every k is judged against it.
            choice = Choice(0, 0.0)
        else:
            proposed, accepting = self.acceptance.rates()
            expected = self.expected(proposed, accepting)
            seconds = self.step_seconds(num_tokens, num_drafting, proposed)
            # Expected emitted tokens per second at each k.
            rates = [
                (num_rows + num_drafting * accepted) / t if t else 0.0
                for (_, accepted), t in zip(expected, seconds, strict=True)
            ]
            best = max(range(self.max_k + 1), key=lambda k: (rates[k], -k))  # ties: fewer
            choice = Choice(best, rates[best])
            if best == 0 and self._steps_since_drafts >= self.probe_interval(
                num_tokens, num_drafting, expected[1][0]
            ):
                choice = Choice(1, rates[1], probe=True)
        self.last = choice
        self.chosen[choice.k] += 1
        return choice

    def describe(self) -> dict:
        """What the policy learned and chose, for a benchmark's record."""
        p, a = self.acceptance.rates()
        return {
            "step_s_by_tokens": {k: self.costs.estimate(k) for k in self.costs._keys},
            "sync_step_s_by_tokens": {
                k: self.sync_costs.estimate(k) for k in self.sync_costs._keys
            },
            "proposal_rates": p,
            "acceptance_rates": a,
            "steps_by_k": list(self.chosen),
        }

    def probe_interval(self, num_tokens: int, num_drafting: int, drafted: float = 1.0) -> int:
        """Steps between k = 1 probes while k = 0 wins (`drafted`: drafts a row expects at
        k = 1): a probe's extra time over the interval's is at most probe_budget (at least 8
        steps, at most max_probe_interval). A probe costs its own extra time twice: the step
        before it loses its overlap too (a proposal waits for the step in flight). Counted
        once, the 1% budget cost 2.5% at batch 64 (Llama-3-8B shape, zero-acceptance replay,
        H200, 9002030: 0.975x of plain decode)."""
        base = self.seconds(num_tokens, overlapped=True) or 0.0
        probe = self.seconds(num_tokens + num_drafting * drafted, overlapped=False) or base
        if base <= 0:
            return 8
        extra = 2 * max(probe - base, 0.0) / base
        return max(8, min(self.max_probe_interval, math.ceil(extra / self.probe_budget)))
