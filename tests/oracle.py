"""The HF oracle for engine-level tests: greedy continuations computed by transformers."""

from __future__ import annotations

import random

import torch

from compile_engine import SamplingParams

NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    """HF's own argmax, step by step over the whole sequence (no cache: the plainest oracle)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = hf_model(torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :]


def mixed_prompts(vocab: int, seed: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared_prefix)]
    lengths = [1, 5, 17, 33, 8, 24, 2]
    return [prefix + [rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def greedy_divergences(got: list[list[int]], want_outputs) -> list[tuple[int, int, float]]:
    """Where each greedy sequence `got` first leaves the reference's (`want_outputs`: its
    CompletionOutputs, generated with logprobs >= 2): (sequence, position, the reference's
    logprob gap between its own choice and `got`'s token there). A token the reference did not
    rank in its top list has an infinite gap. Past a divergence the contexts differ, so only
    the first one of a sequence is comparable."""
    found = []
    for s, (tokens, want) in enumerate(zip(got, want_outputs, strict=True)):
        for i, (a, b) in enumerate(zip(tokens, want.token_ids, strict=True)):
            if a != b:
                top = dict(want.logprobs[i].top)
                gap = top[b] - top[a] if a in top else float("inf")
                found.append((s, i, gap))
                break
    return found


def assert_greedy_near_ties(
    got: list[list[int]], want_outputs, max_gap: float, min_equal: float = 0.0
) -> None:
    """`got` (greedy tokens) follows the reference's greedy tokens except where the reference
    itself nearly tied: each sequence's first divergence picks a token the reference scored
    within `max_gap` nats of its own choice. With random weights the logits are nearly flat,
    so rounding (an FP8 cache, another kernel's accumulation order) flips near-ties; a wrong
    kernel picks tokens far from the reference's choice. And at least `min_equal` of all the
    tokens equal the reference's."""
    far = [d for d in greedy_divergences(got, want_outputs) if d[2] > max_gap]
    assert not far, f"first divergences (sequence, position, gap) beyond {max_gap}: {far}"
    pairs = [(a, b) for g, w in zip(got, want_outputs, strict=True)
             for a, b in zip(g, w.token_ids, strict=True)]  # fmt: skip
    equal = sum(a == b for a, b in pairs)
    assert equal >= min_equal * len(pairs), f"{equal} of {len(pairs)} tokens equal: {got}"
