"""Verification of draft tokens: which of a row's drafts the target accepts, and its own token
after them, such that every emitted token is distributed exactly as non-speculative sampling
would draw it (Leviathan et al. 2023, Chen et al. 2023).

A speculative row of a request with k drafts has 1 + k logits rows: row j scores the token
after the request's tokens plus drafts d_1..d_j, so row j verifies d_{j+1} (the last row
verifies nothing and gives the bonus token). Each row is sampled as the sampler would with that
history (the runner builds the SamplingBatch with outputs + d_1..d_j, so penalties and
min_tokens see what they would have seen), and `Sampler.distribution` gives the target's
greedy token and distribution p.

- Greedy rows accept d while d equals the target's argmax, and emit the argmax: the tokens are
  those of greedy decoding.
- Sampled rows, with a draft distribution q: accept d with probability min(1, p(d) / q(d)),
  else draw from the residual max(0, p - q), renormalised. n-gram proposals and greedy drafts
  are a point mass (q(d) = 1): accept with probability p(d), else draw from p with d removed.
  The bonus row draws from p.

A request's emitted tokens are its accepted drafts (the leading run of accepts) and then the
token of the first row that did not accept. Nothing here reads a device value on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compile_engine.runtime.sampler import Sampler, SamplingBatch, exponential_race
from compile_engine.runtime.structured_output import apply_token_bitmask


@dataclass(slots=True)
class VerifyOutput:
    """Device tensors. Request i's tokens are token_ids[first_i : first_i + num_accepted_i
    + 1], first_i being the sum of the row counts before it."""

    token_ids: torch.Tensor  # [R] what each row emits if it is reached
    num_accepted: torch.Tensor  # [S] long
    last_token_ids: torch.Tensor  # [S] each request's last emitted token (its next input)
    logprobs: torch.Tensor | None = None  # [R] float32, of token_ids
    top_logprob_ids: torch.Tensor | None = None  # [R, K]
    top_logprobs: torch.Tensor | None = None  # [R, K]


def rejection_sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    draft_ids: torch.Tensor,
    counts: list[int],
    draft_probs: torch.Tensor | None = None,
    sampler: Sampler | None = None,
) -> VerifyOutput:
    """logits [R, V]; batch: R rows, each with its request's params and history; draft_ids
    [R] long, the draft row j verifies, -1 on each request's last row; counts [S]: rows per
    request (1 + its drafts), summing to R; draft_probs [R, V]: the draft model's q at each
    row for requests that sample (None: every draft is a point mass)."""
    sampler = sampler or Sampler()
    if batch.token_bitmask is not None:
        logits = apply_token_bitmask(logits, batch.token_bitmask)
    raw_logprobs = None
    if batch.max_num_logprobs is not None:
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1)
    greedy_ids, probs = sampler.distribution(logits.float().clone(), batch)
    has_draft = draft_ids >= 0
    drafts = draft_ids.clamp_min(0)
    greedy_accept = has_draft & (greedy_ids == drafts)
    if probs is None:
        accept, out = greedy_accept, greedy_ids
    else:
        p_draft = probs.gather(1, drafts[:, None]).squeeze(1)
        if draft_probs is None:
            q_draft = torch.ones_like(p_draft)
            # p with the draft removed (rows without one write their own p back: no
            # nonzero(), which would synchronise the host).
            kept = torch.where(has_draft, torch.zeros_like(p_draft), p_draft)
            residual = probs.clone().scatter_(1, drafts[:, None], kept[:, None])
        else:
            q_draft = draft_probs.gather(1, drafts[:, None]).squeeze(1)
            residual = torch.where(has_draft[:, None], (probs - draft_probs).clamp_min(0.0), probs)
        uniform = _uniform(batch, probs.shape[0], probs.device)
        # u < p/q, without dividing: q(d) > 0 for a draft the draft model sampled.
        sampled_accept = has_draft & (uniform * q_draft < p_draft)
        # A residual of zeros means p <= q everywhere, i.e. p == q: acceptance was certain.
        recovered = exponential_race(residual, batch)
        accept = torch.where(batch.greedy, greedy_accept, sampled_accept)
        out = torch.where(batch.greedy, greedy_ids, recovered)
    out = torch.where(accept, drafts, out)
    num_accepted, last = _accepted_runs(accept, out, counts)
    if raw_logprobs is None:
        return VerifyOutput(out, num_accepted, last)
    chosen = raw_logprobs.gather(1, out[:, None]).squeeze(1)
    top_values, top_ids = raw_logprobs.topk(batch.max_num_logprobs, dim=-1)
    return VerifyOutput(out, num_accepted, last, chosen, top_ids, top_values)


def _uniform(batch: SamplingBatch, num_rows: int, device: torch.device) -> torch.Tensor:
    """U[0, 1) per row; seeded rows from their own generators, row by row (as the sampler's
    noise), so that a seeded request's tokens do not depend on what shares its batch."""
    uniform = torch.empty(num_rows, device=device)
    if batch.any_unseeded:
        uniform.uniform_()
    for row, generator in batch.seeded:
        uniform[row : row + 1].uniform_(generator=generator)
    return uniform


def _accepted_runs(
    accept: torch.Tensor, out: torch.Tensor, counts: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request, the length of its leading run of accepted rows and the token of the row
    after it: [S] long each."""
    num_requests, width = len(counts), max(counts)
    device = accept.device
    first = torch.tensor([0, *counts[:-1]], dtype=torch.long).cumsum(0)
    owner = torch.repeat_interleave(torch.arange(num_requests), torch.tensor(counts))
    position = torch.arange(len(owner)) - first[owner]
    padded = torch.zeros(num_requests, width, dtype=torch.long, device=device)
    owner, position, first = (t.to(device, non_blocking=True) for t in (owner, position, first))
    padded[owner, position] = accept.long()
    num_accepted = padded.cumprod(dim=1).sum(dim=1)
    last = out[first + num_accepted]
    return num_accepted, last
