"""Turn one step's logits into next tokens: penalties, greedy or random sampling, logprobs.

Order of processing, per row (HF's and vLLM's order, so results can be compared with theirs):

 0. structured output: tokens a row's grammar forbids get -inf before anything else
    (runtime/structured_output.py), so what follows, logprobs included, sees the constrained
    distribution (vLLM's order).
 0b. logprobs, when any row asked: log_softmax of the *raw* logits in float32, i.e. the
    model's distribution before penalties and temperature (vLLM's default). Prompt tokens are
    scored the same way by `prompt_token_logprobs`, on rows that do not sample.
 1. a float32 copy of the logits; nothing below touches the caller's tensor.
 2. penalties: repetition over tokens seen in the prompt or the output (positive logits are
    divided by it, negative ones multiplied), then frequency and presence over OUTPUT tokens
    only (OpenAI: logit -= frequency * count + presence * (count > 0)).
 3. min_tokens: eos (unless ignore_eos) and stop_token_ids get -inf while the row has fewer
    than min_tokens outputs.
 4. greedy rows (temperature 0) take the argmax here. Other rows go on:
 5. divide by temperature,
 6. top-k: keep every token whose logit >= the k-th largest logit,
 7. top-p: over the top-k survivors, keep the smallest descending-probability prefix whose
    mass reaches top_p, then every token whose probability equals the last one kept,
 8. min-p: keep tokens whose probability >= min_p * the largest probability,
 9. sample by exponential race: argmax(probs / E) with E ~ Exp(1) i.i.d., which picks token
    i with probability probs[i] and needs no cumsum or search.

Tie rule: every mask is a threshold on values, so tokens tied at a boundary are all kept or
all dropped together. top-k and top-p may therefore keep more than k tokens (or more mass
than needed) when there are ties; the result never depends on sort order.

Seeded rows draw their noise from their own torch.Generator, row by row, so a seeded request
gets the same tokens whatever else shares its batch; unseeded rows share one batched draw.

Nothing here reads a device value back to the host: the batch flags that choose the code
path are Python values computed from SamplingParams when the batch is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from compile_engine.runtime.sampling_params import SamplingParams
from compile_engine.runtime.structured_output import apply_token_bitmask


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling state for one step; rows are the sequences that sample, in order.

    Optional tensors are None when no row in the batch needs them, which is what lets an
    all-greedy, penalty-free batch take the argmax-only path.
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    greedy: torch.Tensor  # [S] bool
    temperature: torch.Tensor  # [S, 1] float32; 1.0 on greedy rows so dividing is harmless
    top_k: torch.Tensor | None  # [S, 1] long in [1, V]; V where the row disables top-k
    top_p: torch.Tensor | None  # [S, 1] float32
    min_p: torch.Tensor | None  # [S, 1] float32
    repetition_penalty: torch.Tensor | None  # [S, 1] float32
    seen: torch.Tensor | None  # [S, V] bool: token occurs in the prompt or the output
    frequency_penalty: torch.Tensor | None  # [S, 1] float32
    presence_penalty: torch.Tensor | None  # [S, 1] float32
    output_counts: torch.Tensor | None  # [S, V] float32: occurrences in the output
    banned_rows: torch.Tensor | None  # [N] long  } (row, token) pairs masked by min_tokens
    banned_ids: torch.Tensor | None  # [N] long   }
    seeded: list[tuple[int, torch.Generator]]  # (row, its generator)
    any_unseeded: bool  # whether a non-greedy row without a generator exists
    max_num_logprobs: int | None  # K of top_logprobs; None when no row asked
    token_bitmask: torch.Tensor | None = None  # [S, ceil(V / 32)] int32: allowed tokens' bits

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: Sequence[int] = (),
        num_output_tokens: Sequence[int] | None = None,
        token_bitmask: torch.Tensor | None = None,
    ) -> SamplingBatch:
        """Gather the rows' parameters into tensors, with one host-to-device copy each.

        `generators[i]` is the request's generator (made by the caller from its seed, on
        `device`) or None; it is only used for non-greedy rows. `num_output_tokens[i]` is how
        many tokens precede the one sampled now (min_tokens); by default len(output_token_ids[i]),
        which falls short while earlier tokens are still in flight. `token_bitmask` is the
        structured-output mask on the host (StructuredOutputs.bitmask), None when no row has a
        grammar.
        """
        num_rows = len(params)
        if not len(prompt_token_ids) == len(output_token_ids) == len(generators) == num_rows:
            raise ValueError(
                "params, prompt_token_ids, output_token_ids and generators must "
                "have one entry per sampled row"
            )
        greedy_rows = [p.greedy for p in params]
        sampled = [p for p in params if not p.greedy]

        def column(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return _to_device(torch.tensor(values, dtype=dtype), device).unsqueeze(1)

        def index(values: list[int]) -> torch.Tensor | None:
            return _to_device(torch.tensor(values, dtype=torch.long), device) if values else None

        top_k = top_p = min_p = None
        if any(0 < p.top_k < vocab_size for p in sampled):
            top_k = column([min(p.top_k, vocab_size) or vocab_size for p in params], torch.long)
        if any(p.top_p < 1.0 for p in sampled):
            top_p = column([p.top_p for p in params])
        if any(p.min_p > 0.0 for p in sampled):
            min_p = column([p.min_p for p in params])

        repetition = seen = frequency = presence = counts = None
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            frequency = column([p.frequency_penalty for p in params])
            presence = column([p.presence_penalty for p in params])
            counts = _count_tokens(output_token_ids, vocab_size, device)
        if any(p.repetition_penalty != 1.0 for p in params):
            repetition = column([p.repetition_penalty for p in params])
            in_output = (
                counts
                if counts is not None
                else _count_tokens(output_token_ids, vocab_size, device)
            )
            in_prompt = _count_tokens(prompt_token_ids, vocab_size, device)
            seen = (in_prompt > 0) | (in_output > 0)

        banned_rows: list[int] = []
        banned_ids: list[int] = []
        if num_output_tokens is None:
            num_output_tokens = [len(out) for out in output_token_ids]
        for row, (p, n_out) in enumerate(zip(params, num_output_tokens, strict=True)):
            if n_out < p.min_tokens:
                ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
                ids = sorted(i for i in ids if 0 <= i < vocab_size)
                banned_rows += [row] * len(ids)
                banned_ids += ids

        seeded = [
            (row, g)
            for row, (p, g) in enumerate(zip(params, generators, strict=True))
            if g is not None and not p.greedy
        ]
        requested = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            num_rows=num_rows,
            vocab_size=vocab_size,
            all_greedy=all(greedy_rows),
            greedy=_to_device(torch.tensor(greedy_rows, dtype=torch.bool), device),
            temperature=column([p.temperature if not p.greedy else 1.0 for p in params]),
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition,
            seen=seen,
            frequency_penalty=frequency,
            presence_penalty=presence,
            output_counts=counts,
            banned_rows=index(banned_rows),
            banned_ids=index(banned_ids),
            seeded=seeded,
            any_unseeded=len(seeded) < len(sampled),
            max_num_logprobs=max(requested) if requested else None,
            token_bitmask=None if token_bitmask is None else _to_device(token_bitmask, device),
        )

    @property
    def needs_processing(self) -> bool:
        """Whether any penalty or min_tokens mask changes the logits before choosing."""
        return (
            self.repetition_penalty is not None
            or self.output_counts is not None
            or self.banned_rows is not None
        )


@dataclass(slots=True)
class SamplerOutput:
    """Device tensors; the runner copies them to the host once per step."""

    token_ids: torch.Tensor  # [S] long
    logprobs: torch.Tensor | None = None  # [S] float32, of the chosen token
    top_logprob_ids: torch.Tensor | None = None  # [S, K] long, most likely first
    top_logprobs: torch.Tensor | None = None  # [S, K] float32; row i uses its own first k


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """First index of each row's maximum. On CUDA a two-launch Triton kernel
    (kernels_generated/argmax.py): torch's reduction gives a row to one thread block, 36 us
    for a batch-1 row of Llama-3's 128k vocabulary on the H200. On the CPU `max(dim).indices`
    (the same first index, NaN the maximum as argmax's): SmolLM2's 49,152 logits on the 2-core
    Xeon 21 us a row against argmax's 61, 160 against 489 at 16 rows."""
    if logits.is_cuda:
        from compile_engine.kernels_generated.argmax import MAX_VOCAB, argmax_triton

        if logits.shape[-1] <= MAX_VOCAB:
            return argmax_triton(logits)
        return logits.argmax(dim=-1)
    return logits.max(dim=-1).indices


class Sampler:
    """Stateless: all per-request state lives in the SamplingBatch."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits must be [{batch.num_rows}, V], got {tuple(logits.shape)}")
        if batch.token_bitmask is not None:
            logits = apply_token_bitmask(logits, batch.token_bitmask)
        raw_logprobs = None
        if batch.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)

        if batch.all_greedy and not batch.needs_processing:
            token_ids = greedy_argmax(logits)
        else:
            token_ids = self._choose(logits.float().clone(), batch)
        return self._with_logprobs(token_ids, raw_logprobs, batch.max_num_logprobs)

    def _choose(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Steps 2-9 on a float32 copy, which it modifies in place."""
        greedy_ids, probs = self.distribution(logits, batch)
        if probs is None:
            return greedy_ids
        sampled_ids = exponential_race(probs, batch)
        return torch.where(batch.greedy, greedy_ids, sampled_ids)

    @staticmethod
    def distribution(
        logits: torch.Tensor, batch: SamplingBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Steps 2-8 on float32 logits, which it modifies in place: each row's greedy token
        [S] (after penalties and min_tokens) and, unless every row is greedy, the
        distribution its sampled token is drawn from [S, V] (rows of greedy requests are
        meaningless). Speculative verification accepts drafts against exactly these."""
        apply_penalties(logits, batch)
        if batch.banned_rows is not None:
            logits[batch.banned_rows, batch.banned_ids] = float("-inf")
        greedy_ids = greedy_argmax(logits)
        if batch.all_greedy:
            return greedy_ids, None
        logits.div_(batch.temperature)
        if batch.top_k is not None or batch.top_p is not None:
            apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        probs = torch.softmax(logits, dim=-1)
        if batch.min_p is not None:
            apply_min_p(probs, batch.min_p)
        return greedy_ids, probs

    @staticmethod
    def _with_logprobs(
        token_ids: torch.Tensor, raw_logprobs: torch.Tensor | None, k: int | None
    ) -> SamplerOutput:
        if raw_logprobs is None or k is None:
            return SamplerOutput(token_ids=token_ids)
        chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        top_values, top_ids = raw_logprobs.topk(k, dim=-1)
        return SamplerOutput(token_ids, chosen, top_ids, top_values)


def prompt_token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Score given tokens (the prompt's next ones) under [R, V] logits, as step 0 scores a
    sampled token: log_softmax in float32, then the token's logprob [R], its rank [R] (vLLM's:
    how many tokens are at least as likely, itself included) and the k most likely tokens'
    ids and logprobs [R, k]. The token's logprob and the top values come from one tensor, so a
    token that is the most likely equals the top value exactly (lm-eval's is_greedy test)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [R, 1]
    rank = (logprobs >= chosen).sum(dim=-1)
    top_values, top_ids = logprobs.topk(k, dim=-1)
    return chosen.squeeze(1), rank, top_ids, top_values


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Repetition (HF/vLLM), then frequency and presence (OpenAI), in place on [S, V]."""
    if batch.repetition_penalty is not None:
        penalty = batch.repetition_penalty
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(batch.seen, penalized, logits))
    if batch.output_counts is not None:
        counts = batch.output_counts
        logits.sub_(batch.frequency_penalty * counts)
        logits.sub_(batch.presence_penalty * (counts > 0).float())


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> None:
    """Set to -inf, in place, every logit outside a row's top-k and then its top-p nucleus.

    top_k is [S, 1] long (V disables it), top_p [S, 1] float (1.0 disables it). Both masks are
    value thresholds, so ties at a boundary are kept together.
    """
    sorted_logits = logits.sort(dim=-1, descending=True).values  # [S, V]
    if top_k is not None:
        kth = sorted_logits.gather(1, top_k - 1)  # [S, 1]
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
        logits.masked_fill_(logits < kth, float("-inf"))
    if top_p is None:
        return
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [S, V], mass of better tokens
    # A token is in the nucleus while the tokens before it have not reached top_p yet: at
    # least the first, since mass_before[:, 0] == 0 < top_p, unless top_p itself rounds to 0
    # in float32 (a float64 denormal such as 2.2e-313 passes the API's > 0 check), hence the
    # clamp: the nucleus always keeps the most likely token.
    num_kept = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp_min_(1)  # [S, 1]
    threshold = sorted_logits.gather(1, num_kept - 1)  # [S, 1]
    logits.masked_fill_(logits < threshold, float("-inf"))


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> None:
    """Zero, in place, probabilities below min_p times the row's largest one ([S, 1])."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    probs.masked_fill_(probs < threshold, 0.0)


def exponential_race(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Sample one token per row; argmax(p / E) needs no renormalisation after min-p (nor of
    a rejection sampler's residual)."""
    noise = torch.empty_like(probs)
    if batch.any_unseeded:
        noise.exponential_()
    for row, generator in batch.seeded:
        noise[row].exponential_(generator=generator)
    # exponential_ may return exactly 0 on some backends; p / tiny stays finite for p <= 1.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def _count_tokens(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """[S, V] float32 occurrence counts, built with one padded copy and one scatter_add."""
    width = max((len(ids) for ids in token_ids), default=0)
    # Pad with an extra "vocab_size" column that swallows the padding and is dropped after.
    padded = _to_device(
        torch.tensor(
            [list(ids) + [vocab_size] * (width - len(ids)) for ids in token_ids], dtype=torch.long
        ),
        device,
    ).reshape(len(token_ids), width)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def _to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Copy without waiting: a blocking host-to-device copy synchronises the stream, which
    would make the host wait for the model step queued before it (async scheduling)."""
    return host.to(device, non_blocking=True)
