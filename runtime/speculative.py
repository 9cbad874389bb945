"""Speculative decoding's proposers: who guesses a request's next tokens before the target
verifies them (runtime/rejection_sampler.py) in one forward of 1 + k tokens a row.

`Speculator` is what the engine and runner see: before each step it leaves drafts in
`Request.spec_token_ids` for the running requests that may take them (the scheduler then fits
them into the step), gives the runner the draft distribution of each draft it made, and forgets
a request when it ends. A request gets no drafts while its last token is not on the host (its
step in flight), once its acceptance fell below `min_acceptance_rate` (the scheduler judges
that, `Request.spec_disabled`), or when max_tokens leaves no room; a grammar cuts a constrained
request's drafts to those it accepts (runtime/structured_output.py, `check_drafts`).

- `NgramProposer` (prompt lookup): the continuation of the most recent earlier occurrence of
  the request's last n tokens in its prompt and output, the longest n first. Host only.
- `DraftModelProposer`: a smaller model with the same vocabulary, with its own KV cache (its
  own block tables over its own pool, no prefix caching) and its own `ModelRunner`. Each step it
  catches up on the tokens it has not seen (the prompt at first, then what the last
  verification accepted), then runs k - 1 one-token steps; greedy requests take its argmax
  (a point mass), sampled ones draw from its distribution q with their own parameters, which
  the verifier needs (min(1, p / q)). The drafts come to the host once, after the k forwards.
- `HeadProposer` (runtime/speculative_heads.py): an EAGLE-3 head or DeepSeek's MTP layer over
  the target's hidden states, which the runner hands over each step (`observe`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from compile_engine.compiler.compiled_model import CompiledForward
from compile_engine.compiler.config import CompileConfig
from compile_engine.models.loader import LoadedModel, load_model
from compile_engine.runtime.engine_config import EngineConfigError
from compile_engine.runtime.kv_cache_manager import KVCacheManager
from compile_engine.runtime.model_runner import ModelRunner, allocate_kv_caches, kv_bytes_per_block
from compile_engine.runtime.request import Request
from compile_engine.runtime.scheduler import ScheduledRequest, SchedulerOutput
from compile_engine.runtime.speculative_config import SpeculativeConfig
from compile_engine.runtime.speculative_heads import DraftSampler, HeadProposer

# Idle n-gram requests looked up again a step, at most (`Speculator._rearm`): about 12 us each
# on the CPU, so a batch of 256 idle requests pays ~0.2 ms a step, not ~3.
REARM_PER_STEP = 16


class NgramProposer:
    """Prompt lookup over each request's tokens, kept as a growing numpy array per request so
    that a step converts only its new tokens."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}  # id -> (buffer, length)

    def propose(self, request: Request, k: int) -> list[int]:
        tokens = self._array(request)
        return ngram_lookup(tokens, self.min_n, self.max_n, k)

    def matches(self, request: Request) -> bool:
        """Whether the request's known tokens (not those in flight) end in an n-gram that
        occurred before: a request idle for want of matches asks again."""
        return bool(ngram_lookup(self._array(request), self.min_n, self.max_n, 1))

    def _array(self, request: Request) -> np.ndarray:
        buffer, length = self._tokens.get(request.request_id, (np.empty(0, np.int64), 0))
        n = len(request.all_token_ids)
        if n > len(buffer):
            grown = np.empty(max(2 * len(buffer), n, 64), np.int64)
            grown[:length] = buffer[:length]
            buffer = grown
        buffer[length:n] = request.all_token_ids[length:n]
        self._tokens[request.request_id] = (buffer, n)
        return buffer[:n]

    def release(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the last n tokens,
    for the largest n in [min_n, max_n] that occurs; [] when none does.

    Candidates are the earlier positions of the last token (one comparison over the history);
    each n checks only those, a token back at a time. On the H200 host the sliding-window
    form (every window of every n compared) took 0.18 ms a SmolLM2 verification step."""
    length = len(tokens)
    top = min(max_n, length - 1)
    if top < min_n:
        return []
    # Ends of earlier occurrences, each with a token after it.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    if not ends.size:
        return []
    match = np.ones(ends.size, dtype=bool)  # the tokens before an end agree so far
    agree = [match]  # agree[j]: the last j + 1 tokens agree
    for j in range(1, top):
        back = ends - j
        ok = back >= 0
        match = match & ok
        match[ok] &= tokens[back[ok]] == tokens[length - 1 - j]
        agree.append(match)
    for n in range(top, min_n - 1, -1):
        hits = ends[agree[n - 1]]
        if hits.size:
            start = int(hits[-1]) + 1
            return tokens[start : start + k].tolist()
    return []


@dataclass(slots=True, eq=False)
class _DraftSequence:
    """The draft model's view of one request, in the shape KVCacheManager keeps tables for."""

    request_id: str
    num_computed_tokens: int = 0  # positions whose draft KV holds the request's real tokens
    cache_salt: None = None
    all_token_ids: list[int] = field(default_factory=list)  # unused: no prefix caching
    proposed_from: int = 0  # num_tokens when it last proposed
    drafts: list[int] = field(default_factory=list)


class DraftModelProposer(DraftSampler):
    def __init__(
        self,
        loaded: LoadedModel,
        runner: ModelRunner,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        """loaded: the draft model; runner: a ModelRunner over it and its own KV caches of
        num_blocks blocks (`allocate_kv_caches`)."""
        super().__init__(device)
        self.loaded = loaded
        self.runner = runner
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.sequences: dict[str, _DraftSequence] = {}
        self.draft_probs: dict[str, torch.Tensor] = {}  # id -> [k, V] q of its drafts

    def release(self, request_id: str) -> None:
        sequence = self.sequences.pop(request_id, None)
        if sequence is not None:
            self.kv.free(sequence)
        self.generators.pop(request_id, None)
        self.draft_probs.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Drafts for each (request, k) whose draft KV slots can be had."""
        self.draft_probs = {}
        rows: list[tuple[Request, _DraftSequence, int]] = []
        for request, k in wanted:
            sequence = self._catch_up_point(request)
            needed = request.num_tokens + k - 1 - sequence.num_computed_tokens
            if self.kv.allocate_slots(sequence, needed):
                rows.append((request, sequence, k))
        if not rows:
            return {}
        # Round 0: every token the draft has not computed, sampling after the last one.
        step = [
            self._scheduled(
                request,
                sequence,
                sequence.num_computed_tokens,
                request.all_token_ids[sequence.num_computed_tokens :],
            )
            for request, sequence, _ in rows
        ]
        logits = self.runner.forward_logits(SchedulerOutput(step, 0, []))
        tokens, probs = self._choose(logits, [r for r, _, _ in rows])
        columns, q_columns = [tokens], [probs]
        live = list(range(len(rows)))
        for j in range(1, max(k for _, _, k in rows)):
            # Rounds 1..k-1: the previous draft at position num_tokens - 1 + j.
            keep = [i for i in live if rows[i][2] > j]
            index = torch.tensor([live.index(i) for i in keep], device=self.device)
            previous = columns[-1][index]
            live = keep
            step = [
                self._scheduled(rows[i][0], rows[i][1], rows[i][0].num_tokens - 1 + j, [0])
                for i in live
            ]
            logits = self.runner.forward_logits(SchedulerOutput(step, 0, []), previous)
            tokens, probs = self._choose(logits, [rows[i][0] for i in live])
            columns.append(tokens)
            q_columns.append(probs)
        return self._collect(rows, columns, q_columns)

    def _catch_up_point(self, request: Request) -> _DraftSequence:
        """The request's draft sequence, its computed count cut back to the drafts of its last
        proposal that the request's tokens confirm (never past its last token, which the
        draft must feed to get logits)."""
        sequence = self.sequences.get(request.request_id)
        if sequence is None:
            sequence = self.sequences[request.request_id] = _DraftSequence(request.request_id)
            return sequence
        # Position start + m holds draft m (all but the last were fed back).
        tokens, start, matched = request.all_token_ids, sequence.proposed_from, 0
        for draft in sequence.drafts[:-1]:
            if start + matched >= len(tokens) or tokens[start + matched] != draft:
                break
            matched += 1
        valid = min(sequence.num_computed_tokens, start + matched)
        sequence.num_computed_tokens = min(valid, request.num_tokens - 1)
        return sequence

    def _scheduled(
        self, request: Request, sequence: _DraftSequence, start: int, token_ids: list[int]
    ) -> ScheduledRequest:
        return ScheduledRequest(
            request=request,
            num_computed_tokens=start,
            num_new_tokens=len(token_ids),
            block_ids=self.kv.get_block_ids(sequence.request_id),
            samples=True,
            new_token_ids=list(token_ids),
        )

    def _collect(
        self,
        rows: list[tuple[Request, _DraftSequence, int]],
        columns: list[torch.Tensor],
        q_columns: list[torch.Tensor | None],
    ) -> dict[str, list[int]]:
        """Bring the drafts to the host (the proposer's one sync) and record what each
        sequence computed."""
        host = [c.tolist() for c in columns]
        # Column j holds the rows still drafting at round j, in row order.
        drafted: dict[str, list[int]] = {}
        where: dict[str, list[tuple[int, int]]] = {}
        for j, column in enumerate(host):
            live = [i for i, (_, _, k) in enumerate(rows) if k > j]
            for position, i in enumerate(live):
                rid = rows[i][0].request_id
                drafted.setdefault(rid, []).append(column[position])
                where.setdefault(rid, []).append((j, position))
        for request, sequence, k in rows:
            rid = request.request_id
            sequence.proposed_from = request.num_tokens
            sequence.num_computed_tokens = request.num_tokens + k - 1
            sequence.drafts = drafted[rid]
            if not request.sampling_params.greedy:
                self.draft_probs[rid] = torch.stack([q_columns[j][p] for j, p in where[rid]])
        return drafted


class Speculator:
    """The engine's speculative decoding: a proposer and the policy of who gets drafts."""

    def __init__(
        self, config: SpeculativeConfig, proposer: NgramProposer | DraftModelProposer | HeadProposer
    ) -> None:
        self.config = config
        self.proposer = proposer
        self._rearm_turn = 0

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    def propose(
        self,
        running: list[Request],
        check: Callable[[Request], None] | None = None,
        num_drafts: int | None = None,
    ) -> list[tuple[Request, int]]:
        """Leave drafts in `spec_token_ids` of the running requests that may take them this
        step (and clear everyone else's), at most `num_drafts` each (None: the config's k;
        the engine's runtime/spec_policy.py chooses); `check` may then cut a request's drafts
        (a grammar keeps those it accepts). Returns the (request, drafts it could take) asked."""
        for request in running:
            request.spec_token_ids = []
        if isinstance(self.proposer, HeadProposer):
            # A head reads the features of every computed position, drafting this step or not.
            self.proposer.catch_up()
        limit = self.config.disable_by_batch_size
        if num_drafts == 0 or (limit is not None and len(running) >= limit):
            return []
        if isinstance(self.proposer, NgramProposer):
            self._rearm(running)
        k = self.config.num_speculative_tokens if num_drafts is None else num_drafts
        wanted = []
        for request in running:
            room = min(k, request.max_tokens - request.num_output_tokens - 1)
            if room > 0 and self._eligible(request):
                wanted.append((request, room))
        if not wanted:
            return []
        proposer = self.proposer
        if isinstance(proposer, NgramProposer):
            for request, k in wanted:
                request.spec_token_ids = proposer.propose(request, k)
        else:
            drafted = proposer.propose(wanted)
            for request, _ in wanted:
                request.spec_token_ids = drafted.get(request.request_id, [])
        if check is not None:
            for request, _ in wanted:
                if request.spec_token_ids and request.sampling_params.structured_outputs:
                    check(request)
        window = self.config.acceptance_window
        for request, _ in wanted:
            # A request that keeps finding nothing to propose (no n-gram match) stops asking
            # (while any request may still speculate, the engine steps synchronously) until
            # its tokens match again (`_rearm`).
            if request.spec_token_ids:
                request.spec_steps_without_drafts = 0
            else:
                request.spec_steps_without_drafts += 1
                if request.spec_steps_without_drafts >= window:
                    request.spec_disabled = request.spec_idle = True
        return wanted

    def _rearm(self, running: list[Request]) -> None:
        """n-gram proposals of a request idle for want of matches resume once its known
        tokens end in an n-gram seen before (a rewrite starts copying again after new text):
        the lookup runs while its step is in flight, so idle requests still step
        asynchronously. At most REARM_PER_STEP idle requests a step are looked up, in turn."""
        idle = [request for request in running if request.spec_idle]
        if not idle:
            return
        stride = -(-len(idle) // REARM_PER_STEP)
        self._rearm_turn += 1
        for i, request in enumerate(idle):
            if (i + self._rearm_turn) % stride == 0 and self.proposer.matches(request):
                request.spec_idle = request.spec_disabled = False
                request.spec_steps_without_drafts = 0

    @staticmethod
    def may_draft(request: Request) -> bool:
        """Whether a running request would be asked for drafts once its step in flight lands:
        proposals not turned off, its prompt computed, room under max_tokens."""
        return (
            not request.spec_disabled
            and request.num_computed_tokens >= request.num_prompt_tokens
            and request.num_output_tokens + request.num_pending_tokens < request.max_tokens - 1
        )

    @staticmethod
    def _eligible(request: Request) -> bool:
        return (
            not request.spec_disabled
            and not request.num_pending_tokens
            and not request.num_drafts_in_flight
            and request.num_computed_tokens == request.num_tokens - 1
        )

    @property
    def needs_draft_probs(self) -> bool:
        """Whether a sampled request's drafts come with a distribution q (a draft model's)."""
        return not isinstance(self.proposer, NgramProposer)

    def draft_probs(self, request_id: str, n: int) -> torch.Tensor | None:
        """q of the request's first n drafts [n, V], or None for a point mass (n-gram, or a
        greedy request's draft argmax)."""
        if isinstance(self.proposer, NgramProposer):
            return None
        probs = self.proposer.draft_probs.get(request_id)
        return None if probs is None else probs[:n]

    def release(self, request_id: str) -> None:
        self.proposer.release(request_id)

    def observe(self, scheduled: list[ScheduledRequest], output: torch.Tensor) -> torch.Tensor:
        """The target's hidden states [T, H] of a step's forward output; a head proposer keeps
        its features (runtime/speculative_heads.py)."""
        if isinstance(self.proposer, HeadProposer):
            return self.proposer.observe(scheduled, output)
        return output


def load_draft(
    config: SpeculativeConfig | None, target: LoadedModel, device: torch.device, max_model_len: int
) -> LoadedModel | None:
    """The draft model of a draft_model config, in the target's dtype, checked against the
    target's vocabulary (None for other methods)."""
    if config is None or config.method != "draft_model":
        return None
    draft = load_model(config.model, dtype=target.dtype, device=device)
    if draft.config.vocab_size != target.config.vocab_size:
        raise EngineConfigError(
            f"speculative_config: the draft model {config.model} has a vocabulary of "
            f"{draft.config.vocab_size} tokens, the target {target.config.vocab_size}; a draft "
            "must share the target's tokenizer"
        )
    if draft.config.max_position_embeddings < max_model_len:
        raise EngineConfigError(
            f"speculative_config: the draft model {config.model} supports "
            f"{draft.config.max_position_embeddings} positions, fewer than max_model_len="
            f"{max_model_len}; lower max_model_len"
        )
    return draft


def share_kv_pool(num_blocks: int, target: LoadedModel, draft: LoadedModel, block_size: int) -> int:
    """The target's share of a KV budget sized for it alone, when the draft's cache takes the
    same number of blocks beside it."""
    mine, theirs = kv_bytes_per_block(target, block_size), kv_bytes_per_block(draft, block_size)
    return max(2, num_blocks * mine // (mine + theirs))


def build_speculator(
    config: SpeculativeConfig,
    draft: LoadedModel | None,
    *,
    num_blocks: int,
    block_size: int,
    device: torch.device,
    seed: int,
    compile_config: CompileConfig | None,
    head: LoadedModel | None = None,
    target: LoadedModel | None = None,
    proposer: object | None = None,
) -> Speculator:
    """The engine's speculator; a draft model gets a KV cache of num_blocks blocks (the
    target's count) and runs compiled with `compile_config` (None: eagerly), without CUDA
    graphs; a head (eagle3, mtp: `load_head`) gets such a cache and runs eagerly beside the
    `target`. A given `proposer` (a benchmark's, with DraftModelProposer's `propose(wanted)`,
    `release` and `draft_probs`) replaces the method's."""
    if proposer is not None:
        return Speculator(config, proposer)
    if config.method == "ngram":
        return Speculator(config, NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max))
    if head is not None:
        from compile_engine.runtime.speculative_heads import build_head_proposer

        proposer = build_head_proposer(
            head, target, num_blocks=num_blocks, block_size=block_size, device=device
        )
        return Speculator(config, proposer)
    kv_caches = allocate_kv_caches(draft, num_blocks, block_size, device)
    forward = None
    if compile_config is not None:
        forward = CompiledForward(draft.model, compile_config, draft.dtype)
        forward.capture(kv_caches)
    runner = ModelRunner(
        draft,
        kv_caches,
        block_size=block_size,
        num_blocks=num_blocks,
        device=device,
        seed=seed,
        forward=forward,
    )
    proposer = DraftModelProposer(
        draft, runner, num_blocks=num_blocks, block_size=block_size, device=device
    )
    return Speculator(config, proposer)
