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
