"""Draft heads that read the target's hidden states: EAGLE-3 (models/eagle3.py) and DeepSeek's
MTP (models/mtp.py). runtime/speculative.py's `Speculator` drives them as it drives a draft
model; this file is what differs.

A head at position p reads the token after p and the target's features at p (EAGLE-3: three
aux hidden states; MTP: the final hidden state) and predicts the token after that. So:

- The runner hands every step's features to `observe` (`Speculator.observe`), which keeps a
  copy of each request's rows (a copy: CUDA-graph output buffers are overwritten by the next
  replay, and an asynchronous step may run before the rows are read).
- `catch_up`, before each step's proposals, runs the head over every position the target has
  computed and whose next token is known, for every tracked request, in one batch: the head's
  own KV cache (one layer, its own block tables over its own pool of the target's block
  count, no prefix caching) then holds each position computed from the target's features.
  Rows the verifier rejected never reach it (only positions below num_computed_tokens do).
  Positions the target never computed for this request (a prefix-cache hit) have no features:
  the head reads zeros there, so its drafts after a cached prefix are worse, never wrong.
- `propose` takes the catch-up's last output of each drafting request for the first draft,
  then runs k - 1 one-token steps feeding its own output back (the head's KV at those
  speculative positions is rewritten by the next catch-up). Greedy requests take the argmax;
  sampled ones draw from the head's distribution q with their own parameters (min(1, p / q)
  needs it). Drafts reach the host once, after the k steps.

The head runs eagerly: its forward has the features as an extra input, which CompiledForward's
signature lacks, and a head is one layer (its per-step cost is what `bench latency` records as
spec_draft_step_ms_bs1). KV is kept rather than recomputed: recomputing would cost a head pass
over the whole context per draft step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from compile_engine.models.layers import AttentionMetadata
from compile_engine.models.loader import LoadedModel
from compile_engine.runtime.kv_cache_manager import KVCacheManager
from compile_engine.runtime.request import Request
from compile_engine.runtime.sampler import Sampler, SamplingBatch, exponential_race
from compile_engine.runtime.scheduler import ScheduledRequest


@dataclass(slots=True, eq=False)
class _HeadSequence:
    """The head's view of one request, in the shape KVCacheManager keeps tables for."""

    request_id: str
    request: Request
    num_computed_tokens: int = 0  # positions whose head KV was computed from target features
    cache_salt: None = None
    all_token_ids: list[int] = field(default_factory=list)  # unused: no prefix caching
    chunks: list[tuple[int, Tensor]] = field(default_factory=list)  # (position, rows [n, F])
    last_out: Tensor | None = None  # [H] the head's output at num_computed_tokens - 1


def _metadata(
    groups: list[tuple[list[int], int, int]], block_size: int, device: torch.device
) -> tuple[Tensor, AttentionMetadata]:
    """Positions and attention metadata of a packed batch of (block ids, first position,
    tokens) groups, as ModelRunner.prepare builds them."""
    n_new = np.array([n for _, _, n in groups], dtype=np.int64)
    first = np.array([p for _, p, _ in groups], dtype=np.int64)
    starts = np.zeros(len(groups) + 1, dtype=np.int32)
    np.cumsum(n_new, out=starts[1:])
    width = max(len(b) for b, _, _ in groups)
    tables = np.zeros((len(groups), width), dtype=np.int32)
    for row, (blocks, _, _) in enumerate(groups):
        tables[row, : len(blocks)] = blocks
    owner = np.repeat(np.arange(len(groups)), n_new)
    positions = np.arange(int(starts[-1]), dtype=np.int64) - starts[owner] + first[owner]
    slots = tables[owner, positions // block_size].astype(np.int64) * block_size
    slots += positions % block_size
    meta = AttentionMetadata(
        *(
            torch.from_numpy(a).to(device, non_blocking=True)
            for a in (slots, tables, (first + n_new).astype(np.int32), starts)
        )
    )
    return torch.from_numpy(positions).to(device, non_blocking=True), meta


class DraftSampler:
    """How a proposer draws its drafts: each request's own sampling parameters on the
    draft's logits, seeded requests from a generator of their own (the request's seed salted,
    so drafts do not replay the target's draws: the draft's draws and the target's acceptance
    tests are not one stream). DraftModelProposer and HeadProposer share it."""

    _DRAFT_SEED_SALT = 0x5EED5EED

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.generators: dict[str, torch.Generator] = {}
        self.sampler = Sampler()

    def _generator(self, request: Request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        generator = self.generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed((seed + request.sibling_index) ^ self._DRAFT_SEED_SALT)
            self.generators[request.request_id] = generator
        return generator

    def _choose(self, logits: Tensor, requests: list[Request]) -> tuple[Tensor, Tensor | None]:
        """Each row's draft [B] and, unless all are greedy, q [B, V] it was drawn from."""
        batch = SamplingBatch.build(
            [r.sampling_params for r in requests],
            [r.prompt_token_ids for r in requests],
            [r.output_token_ids for r in requests],
            [self._generator(r) for r in requests],
            vocab_size=logits.shape[-1],
            device=self.device,
        )
        greedy_ids, probs = self.sampler.distribution(logits.float(), batch)
        if probs is None:
            return greedy_ids, None
        return torch.where(batch.greedy, greedy_ids, exponential_race(probs, batch)), probs


class HeadProposer(DraftSampler):
    def __init__(
        self,
        head: LoadedModel,
        kv_caches: list[Tensor],
        *,
        embed: Callable[[Tensor], Tensor],
        lm_head: Callable[[Tensor], Tensor],
        hidden_size: int,
        num_blocks: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        """head: the loaded head (Eagle3Head or DeepseekMTP); kv_caches: its cache of
        num_blocks blocks (`allocate_kv_caches`); embed / lm_head: the token embedding and
        output projection it shares with the target (an EAGLE-3 head's own embedding when its
        checkpoint has one); hidden_size: the target's, where its features start in the
        forward's output."""
        self.head = head.model
        self.kv_caches = kv_caches
        self.embed, self.lm_head = embed, lm_head
        self.hidden_size = hidden_size
        self.dtype = head.dtype
        super().__init__(device)
        self.block_size = block_size
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.sequences: dict[str, _HeadSequence] = {}
        self.draft_probs: dict[str, Tensor] = {}  # id -> [k, V] q of its drafts

    # -- the target's features -----------------------------------------------------------

    def observe(self, scheduled: list[ScheduledRequest], output: Tensor) -> Tensor:
        """Keep each scheduled request's feature rows of a step whose forward returned
        `output` [T, H (+ F)] (rows in schedule order); return the hidden states [T, H]."""
        width = self.head.feature_size
        if output.shape[-1] != self.hidden_size + width:
            raise RuntimeError(
                f"the target's forward returned {output.shape[-1]} columns, the head needs "
                f"{self.hidden_size} + {width}: was the model compiled before its aux hidden "
                "states were exposed?"
            )
        hidden = output[:, : self.hidden_size]
        features = output[:, self.hidden_size :] if width else hidden
        rows, kept, start = [], [], 0
        for it in scheduled:
            request = it.request
            if not request.spec_disabled:
                rows.append(np.arange(start, start + it.num_new_tokens))
                kept.append((request, it.num_computed_tokens, it.num_new_tokens))
            start += it.num_new_tokens
        if kept:
            index = torch.from_numpy(np.concatenate(rows)).to(self.device, non_blocking=True)
            copy = features.index_select(0, index)  # [R, F]
            for (request, position, _), part in zip(
                kept, copy.split([n for _, _, n in kept]), strict=True
            ):
                sequence = self.sequences.get(request.request_id)
                if sequence is None:
                    sequence = self.sequences[request.request_id] = _HeadSequence(
                        request.request_id, request
                    )
                # The target recomputes from `position` (a new step, or after preemption):
                # rows kept from before at those positions are stale.
                sequence.chunks = [
                    (p, rows[: position - p]) for p, rows in sequence.chunks if p < position
                ]
                sequence.chunks.append((position, part))
        return hidden

    def _features(self, sequence: _HeadSequence, start: int, end: int, width: int) -> Tensor:
        """Rows [end - start, F] of positions start..end-1 from the kept chunks, zeros where
        none was kept; the chunks are then cut to the target's computed positions past end."""
        pieces, covered = [], start
        for position, rows in sequence.chunks:  # in position order (`observe`)
            lo, hi = max(position, covered), min(position + rows.shape[0], end)
            if lo >= hi:
                continue
            if lo > covered:
                pieces.append(self._zeros(lo - covered, width))
            pieces.append(rows[lo - position : hi - position])
            covered = hi
        if covered < end:
            pieces.append(self._zeros(end - covered, width))
        self._trim(sequence, end)
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def _zeros(self, n: int, width: int) -> Tensor:
        return torch.zeros(n, width, dtype=self.dtype, device=self.device)

    @staticmethod
    def _trim(sequence: _HeadSequence, end: int) -> None:
        """Keep the chunk rows at positions end.. below the target's computed count (the rows
        past it verified drafts that were rejected)."""
        limit = sequence.request.num_computed_tokens
        kept = []
        for position, rows in sequence.chunks:
            lo, hi = max(position, end), min(position + rows.shape[0], limit)
            if lo < hi:
                kept.append((lo, rows[lo - position : hi - position]))
        sequence.chunks = kept

    @torch.inference_mode()
    def catch_up(self) -> None:
        """Run the head over every tracked request's positions that have features and a
        known next token (module docstring), one batch for all."""
        groups, ids, features, sequences = [], [], [], []
        for rid in list(self.sequences):
            sequence = self.sequences[rid]
            request = sequence.request
            if request.spec_disabled or request.is_finished:
                self.release(rid)
                continue
            if request.num_drafts_in_flight:
                continue  # its verification is not back yet
            start = sequence.num_computed_tokens
            end = min(request.num_computed_tokens, request.num_tokens - 1)
            if end <= start:
                self._trim(sequence, start)
                continue
            if not self.kv.allocate_slots(sequence, end - start):
                # The head's pool is full: this request drafts no more.
                self.release(rid)
                request.spec_disabled = True
                continue
            width = self.head.feature_size or self.hidden_size
            features.append(self._features(sequence, start, end, width))
            ids.append(request.all_token_ids[start + 1 : end + 1])
            groups.append((self.kv.get_block_ids(rid), start, end - start))
            sequences.append((sequence, end))
        if not groups:
            return
        positions, meta = _metadata(groups, self.block_size, self.device)
        tokens = torch.tensor([t for row in ids for t in row], device=self.device)
        hidden = self.head.fuse(torch.cat(features))
        out = self.head(self.embed(tokens), positions, hidden, self.kv_caches, meta)
        last = 0
        for (sequence, end), (_, _, n) in zip(sequences, groups, strict=True):
            last += n
            sequence.num_computed_tokens = end
            sequence.last_out = out[last - 1]

    # -- drafting --------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Drafts for each (request, k) the head has caught up with."""
        self.draft_probs = {}
        self.catch_up()
        rows: list[tuple[Request, _HeadSequence, int]] = []
        for request, k in wanted:
            sequence = self.sequences.get(request.request_id)
            if sequence is None or sequence.last_out is None:
                continue
            if sequence.num_computed_tokens != request.num_tokens - 1:
                continue
            if k > 1 and not self.kv.allocate_slots(sequence, k - 1):
                k = 1  # no room for the speculative positions: one draft
            rows.append((request, sequence, k))
        if not rows:
            return {}
        out = torch.stack([s.last_out for _, s, _ in rows])  # [B, H]
        logits = self.head.compute_logits(out, self.lm_head)
        tokens, probs = self._choose(logits, [r for r, _, _ in rows])
        columns, q_columns = [tokens], [probs]
        live = list(range(len(rows)))
        for j in range(1, max(k for _, _, k in rows)):
            keep = [i for i in live if rows[i][2] > j]
            index = torch.tensor([live.index(i) for i in keep], device=self.device)
            previous, out = columns[-1][index], out[index]
            live = keep
            # Position num_tokens - 2 + j: the previous draft, after the head's own output.
            groups = [
                (self.kv.get_block_ids(rows[i][0].request_id), rows[i][0].num_tokens - 2 + j, 1)
                for i in live
            ]
            positions, meta = _metadata(groups, self.block_size, self.device)
            out = self.head(self.embed(previous), positions, out, self.kv_caches, meta)
            logits = self.head.compute_logits(out, self.lm_head)
            tokens, probs = self._choose(logits, [rows[i][0] for i in live])
            columns.append(tokens)
            q_columns.append(probs)
        return self._collect(rows, columns, q_columns)

    def _collect(
        self,
        rows: list[tuple[Request, _HeadSequence, int]],
        columns: list[Tensor],
        q_columns: list[Tensor | None],
    ) -> dict[str, list[int]]:
        host = [c.tolist() for c in columns]  # the proposer's one sync
        drafted: dict[str, list[int]] = {}
        where: dict[str, list[tuple[int, int]]] = {}
        for j, column in enumerate(host):
            live = [i for i, (_, _, k) in enumerate(rows) if k > j]
            for position, i in enumerate(live):
                rid = rows[i][0].request_id
                drafted.setdefault(rid, []).append(column[position])
                where.setdefault(rid, []).append((j, position))
        for request, _, _ in rows:
            rid = request.request_id
            if not request.sampling_params.greedy:
                self.draft_probs[rid] = torch.stack([q_columns[j][p] for j, p in where[rid]])
        return drafted

    def release(self, request_id: str) -> None:
        sequence = self.sequences.pop(request_id, None)
        if sequence is not None:
            self.kv.free(sequence)
        self.generators.pop(request_id, None)
        self.draft_probs.pop(request_id, None)

    # -- cost ------------------------------------------------------------------------------

    @torch.inference_mode()
    def draft_step_seconds(self, iters: int = 20) -> float:
        """Median time of one draft step at batch 1: the head's one-token forward, its
        logits and the argmax, the device drained around each (position 0 of the scratch
        block 0, which no sequence owns)."""
        block = [0]
        positions, meta = _metadata([(block, 0, 1)], self.block_size, self.device)
        token = torch.zeros(1, dtype=torch.long, device=self.device)
        hidden = self._zeros(1, self.head.config.hidden_size)
        times = []
        for _ in range(iters + 2):
            _synchronize(self.device)
            t0 = time.perf_counter()
            out = self.head(self.embed(token), positions, hidden, self.kv_caches, meta)
            self.head.compute_logits(out, self.lm_head).argmax(-1)
            _synchronize(self.device)
            times.append(time.perf_counter() - t0)
        return float(np.median(times[2:]))  # the first two warm the allocator


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_head(
    config, target: LoadedModel, device: torch.device, max_model_len: int
) -> LoadedModel | None:
    """The draft head of an eagle3 or mtp speculative config (None for other methods), in
    the target's dtype; for eagle3 the target's forward is made to return the aux hidden
    states the head reads (so call this before the target is compiled; a model object shared
    with another engine would return them there too)."""
    from compile_engine.runtime.engine_config import EngineConfigError

    if config is None or config.method not in ("eagle3", "mtp"):
        return None
    if config.method == "mtp":
        from compile_engine.models.mtp import load_mtp_head

        directory = config.model or target.source.directory
        return load_mtp_head(directory, target.config, target.dtype, device, max_model_len)
    from compile_engine.models.eagle3 import load_eagle3_head

    expose = getattr(target.model, "expose_aux_hidden_states", None)
    if expose is None:
        raise EngineConfigError(
            f"speculative_config: method 'eagle3' needs the target's hidden states, which "
            f"{target.config.architecture} does not expose"
        )
    head = load_eagle3_head(config.model, target.config, target.dtype, device, max_model_len)
    expose(head.model.eagle.aux_layer_ids)
    return head


def build_head_proposer(
    head: LoadedModel,
    target: LoadedModel,
    *,
    num_blocks: int,
    block_size: int,
    device: torch.device,
) -> HeadProposer:
    """A proposer over `head` with a KV cache of num_blocks blocks, sharing the target's
    embedding (unless the head has its own) and output projection."""
    from compile_engine.runtime.model_runner import allocate_kv_caches

    embed = getattr(head.model, "embed_tokens", None) or target.model.model.embed_tokens
    return HeadProposer(
        head,
        allocate_kv_caches(head, num_blocks, block_size, device),
        embed=embed,
        lm_head=target.model.compute_logits,
        hidden_size=target.config.hidden_size,
        num_blocks=num_blocks,
        block_size=block_size,
        device=device,
    )
