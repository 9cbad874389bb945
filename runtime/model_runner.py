"""Turns a scheduler step into a packed batch, runs the model, samples.

The runner owns the KV cache tensors and every device buffer. The model is called through
`self.forward`, which the compiler can replace with compiled pieces or CUDA-graph replay; the
inputs it receives are always the same shapes of the same persistent buffers' prefixes.
"""

from __future__ import annotations

import logging
import math
import mmap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from compile_engine.compiler.cuda_graphs import CUDAGraphRunner
from compile_engine.models.layers import AttentionMetadata, RotaryEmbedding
from compile_engine.models.loader import LoadedModel
from compile_engine.runtime.prompt_logprobs import scored_span
from compile_engine.runtime.rejection_sampler import rejection_sample
from compile_engine.runtime.sampler import (
    Sampler,
    SamplerOutput,
    SamplingBatch,
    greedy_argmax,
    prompt_token_logprobs,
)
from compile_engine.runtime.scheduler import PENDING_TOKEN, ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:  # the speculator builds a ModelRunner for a draft model
    from compile_engine.runtime.speculative import Speculator

log = logging.getLogger(__name__)

# CPU default KV pool: this many max_model_len sequences (fewer if max_num_seqs is), within
# CPU_KV_BYTES. A CPU decodes a handful of streams at a useful speed, and the scheduler
# preempts past the pool; a fixed 4 GiB (vLLM's CPU default) held SmolLM2-135M's server at
# 5.3 GB RSS (issue 29). Override with num_kv_blocks.
CPU_KV_SEQUENCES = 2
CPU_KV_BYTES = 4 << 30
# Prompt rows are scored this many at a time, so that a long prefill chunk of a request asking
# for prompt logprobs holds [256, V] float32 logits at once (50 MB for a 49k vocabulary, 128 MB
# for 128k), not [chunk, V]: the size of one step's sampling at max_num_seqs=256, which the KV
# pool's activation reserve already covers.
PROMPT_LOGPROB_ROWS = 256
# CUDA graphs of up to this many tokens also capture the lm_head and each row's argmax after
# the model (`CUDAGraphRunner.capture_heads`): decode batches and verification steps (one row
# a token up to attention.write_first_max_tokens, 16) replay them instead of three Triton
# launches from the host, which bound SmolLM2's steps on the H200.
GRAPH_HEAD_MAX_ROWS = 16


def logits_and_argmax(compute_logits: Callable) -> Callable:
    """hidden rows -> (their logits, each row's argmax): what a head graph captures."""

    def head(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = compute_logits(hidden)
        return logits, greedy_argmax(logits)

    return head


@dataclass(slots=True)
class TokenLogprobs:
    """The model's log-probabilities at one generated position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # most likely first
    # Prompt tokens only (vLLM's): 1 + how many tokens are more likely; ties count as more.
    rank: int | None = None


@dataclass(slots=True)
class PromptRows:
    """The rows of a step that score prompt tokens (runtime/prompt_logprobs.py)."""

    rows: np.ndarray  # [R] token rows of the packed batch
    targets: np.ndarray  # [R] the prompt token each row scores: the one after it
    chunks: list[tuple[str, int, int, int]]  # (request id, first token scored, count, k)
    k: int  # the largest k of the chunks


@dataclass(slots=True)
class SpecRows:
    """The sampling rows of a step whose rows verify drafts (runtime/rejection_sampler.py):
    each sampling request has 1 + its drafts logits rows, its last tokens."""

    counts: list[int]  # [S] logits rows per sampling request
    draft_ids: np.ndarray  # [R] the draft each row verifies; -1 on a request's last row


@dataclass(slots=True)
class PreparedInputs:
    input_ids: torch.Tensor  # [T] host; PENDING_TOKEN where the value is on the device
    positions: torch.Tensor  # [T] host
    meta: AttentionMetadata  # host tensors
    sample_rows: np.ndarray  # [S] the token row of each sampling request ([R] with drafts)
    pending: list[tuple[int, str]]  # (token row, request id) of each pending token
    prompt_rows: PromptRows | None  # None when no request scores its prompt in this step
    spec: SpecRows | None = None  # None when no row verifies drafts


@dataclass(slots=True)
class InFlightStep:
    """A launched step: its device work is queued, its sampled tokens are on their way."""

    step: SchedulerOutput
    sampling: list  # the requests that sample, in row order
    token_ids: torch.Tensor | None  # [S] on the device: inputs of the next step's pending tokens
    host: list[torch.Tensor] | None  # tokens (+ logprobs, top ids, top values) on the host
    done: torch.cuda.Event | None  # recorded after the copies (None on CPU)
    prompt_rows: PromptRows | None = None
    prompt_host: list[torch.Tensor] | None = None  # their logprobs, ranks, top ids, top values
    logits: torch.Tensor | None = None  # [S, V] while sampling waits (launch's defer_sampling)
    argmax: torch.Tensor | None = None  # [S] each logits row's argmax, where a head graph made it
    spec: SpecRows | None = None  # the rows verifying drafts; host then holds their results
    # Greedy verification by argmax alone: host holds every row's argmax, and the host
    # accepts the drafts (`_verified`); token_ids is then None.
    host_verifies: bool = False

    @property
    def drafts(self) -> list[list[int]] | None:
        """The drafts each sampling request verifies, in row order (None: no drafts)."""
        if self.spec is None:
            return None
        ids, out, first = self.spec.draft_ids.tolist(), [], 0
        for count in self.spec.counts:
            out.append(ids[first : first + count - 1])
            first += count
        return out


def _prompt_rows(scheduled: list[ScheduledRequest], starts: np.ndarray) -> PromptRows | None:
    """Which rows of the packed batch score which prompt tokens; None, after one cheap pass,
    when no request of the step asked."""
    if all(it.request.sampling_params.prompt_logprobs is None for it in scheduled):
        return None
    rows, targets, chunks = [], [], []
    for i, it in enumerate(scheduled):
        request = it.request
        first, count = scored_span(request, it.num_computed_tokens, it.num_new_tokens)
        if count:
            # The chunk's first token (position first - 1) sits at row starts[i].
            rows.append(np.arange(starts[i], starts[i] + count, dtype=np.int64))
            targets += request.prompt_token_ids[first : first + count]
            k = request.sampling_params.prompt_logprobs
            chunks.append((request.request_id, first, count, k))
    if not chunks:
        return None
    k = max(c[3] for c in chunks)
    return PromptRows(np.concatenate(rows), np.asarray(targets, dtype=np.int64), chunks, k)


def _prompt_entries(
    plan: PromptRows, host: list[torch.Tensor]
) -> dict[str, tuple[int, list[TokenLogprobs]]]:
    chosen, ranks, top_ids, top_vals = (t.tolist() for t in host)
    targets = plan.targets.tolist()
    entries: dict[str, tuple[int, list[TokenLogprobs]]] = {}
    row = 0
    for rid, first, count, k in plan.chunks:
        scores = []
        for r in range(row, row + count):
            top = list(zip(top_ids[r][:k], top_vals[r][:k], strict=True))
            scores.append(TokenLogprobs(targets[r], chosen[r], top, ranks[r]))
        entries[rid] = (first, scores)
        row += count
    return entries


def _all_pending_in_order(inputs: PreparedInputs, previous: InFlightStep | None) -> bool:
    """Whether every token of the step is pending and token i is the i-th sample of the step
    in flight: then the step's ids are that step's sampled tokens, row for row."""
    if previous is None or previous.token_ids is None:
        return False
    if previous.token_ids.dtype != inputs.input_ids.dtype:
        return False
    n = inputs.input_ids.shape[0]
    if len(inputs.pending) != n or len(previous.sampling) != n:
        return False
    return all(
        pos == i and request.request_id == rid
        for i, ((pos, rid), request) in enumerate(
            zip(inputs.pending, previous.sampling, strict=True)
        )
    )


@dataclass(slots=True)
class StepCounters:
    """Cumulative since start, for the server's metrics: whether serving is bound by the host
    or the device, and how many steps replay a CUDA graph. The runner counts the first four;
    `LLMEngine.step` adds its own time."""

    steps: int = 0  # model runs launched
    tokens: int = 0  # the tokens they computed, before padding
    graph_steps: int = 0  # of those runs, replayed from a CUDA graph
    device_wait_s: float = 0.0  # host time blocked in `collect`, waiting for sampled tokens
    busy_s: float = 0.0  # time inside LLMEngine.step (scheduling, launches, waits, outputs)


@dataclass(slots=True)
class RunnerOutput:
    # request id -> its new tokens, for requests that sampled: one, or with drafts the accepted
    # ones and then the target's own
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]]  # for those that asked, one per token
    # request id -> (first prompt token scored, its scores onwards), for those that asked
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


def allocate_kv_caches(
    loaded: LoadedModel, num_blocks: int, block_size: int, device: torch.device
) -> list[torch.Tensor]:
    """The paged KV cache: one zeroed tensor a layer, `kv_cache_shape(num_blocks, block_size)`
    of `loaded.cache_dtype` (FP8 with kv_cache_dtype "fp8": a block takes half the bytes);
    block 0 is the scratch block padding writes into.

    On the CPU each layer's tensor lies in an anonymous mmap, whose pages the kernel maps
    zeroed on first touch: the pool costs resident memory as blocks are written, not when
    sized (SmolLM2's 2 x 8,192 tokens are 377 MB; `torch.zeros` touches every page). One map
    a layer, not views of one: graph inputs sharing a storage cost AOTAutograd alias checks."""
    shape = loaded.model.kv_cache_shape(num_blocks, block_size)
    layers = loaded.config.num_layers
    dtype = loaded.cache_dtype
    if device.type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
    nbytes = math.prod(shape) * dtype.itemsize
    return [torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape) for _ in range(layers)]


def kv_bytes_per_block(loaded: LoadedModel, block_size: int) -> int:
    element = torch.empty((), dtype=loaded.cache_dtype).element_size()
    per_layer = math.prod(loaded.model.kv_cache_shape(1, block_size))
    return loaded.config.num_layers * per_layer * element


def profile_inputs(loaded: LoadedModel, num_tokens: int) -> tuple:
    """(ids, positions, kv caches, metadata) of the profile's step: one sequence of
    `num_tokens` prompt tokens in a pool just large enough. A step that large holds several
    sequences, none past the model's rotary table, so the positions wrap at the table's length
    (a step of more tokens than the table: an index past it is a device-side assert on CUDA)."""
    cfg, device = loaded.config, next(loaded.model.parameters()).device
    block_size = 16
    blocks = -(-num_tokens // block_size) + 1
    shape = loaded.model.kv_cache_shape(blocks, block_size)
    kv = [
        torch.zeros(shape, dtype=loaded.cache_dtype, device=device) for _ in range(cfg.num_layers)
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(block_size, block_size + num_tokens, device=device),
        block_tables=torch.arange(1, blocks, dtype=torch.int32, device=device)[None],
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
    )
    tables = [m.max_positions for m in loaded.model.modules() if isinstance(m, RotaryEmbedding)]
    positions = torch.arange(num_tokens, device=device) % min(tables, default=num_tokens)
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    return ids, positions, kv, meta


@torch.inference_mode()
def profile_activation_bytes(loaded: LoadedModel, num_tokens: int, num_rows: int) -> int:
    """Peak memory of one eager forward of `num_tokens` tokens plus sampling `num_rows` rows:
    what the KV pool must leave free for activations (and, below, for CUDA graphs)."""
    ids, positions, kv, meta = profile_inputs(loaded, num_tokens)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    hidden = loaded.model(ids, positions, kv, meta)
    logits = loaded.model.compute_logits(hidden[: min(num_rows, num_tokens)]).float()
    torch.softmax(logits, dim=-1)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del kv, hidden, logits
    torch.cuda.empty_cache()
    return peak


def default_num_blocks(
    loaded: LoadedModel,
    block_size: int,
    device: torch.device,
    needed_tokens: int,
    reserve_bytes: int = 0,
    gpu_memory_utilization: float = 0.9,
    max_model_len: int | None = None,
) -> int:
    """Size the pool from memory: all of it that is useful, within the device's budget, after
    `reserve_bytes` for activations and CUDA graphs. On CUDA the budget is what keeps the
    process's use of the device (weights loaded already, so outside `free`) within
    `gpu_memory_utilization` of its memory, as vLLM sizes it. On the CPU: CPU_KV_SEQUENCES
    sequences of `max_model_len` tokens (given), within CPU_KV_BYTES."""
    per_block = kv_bytes_per_block(loaded, block_size)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1 - gpu_memory_utilization) * total - reserve_bytes
    else:
        budget = CPU_KV_BYTES
        if max_model_len is not None:
            blocks = -(-max_model_len // block_size) * CPU_KV_SEQUENCES + 1
            budget = min(budget, blocks * per_block)
    useful = -(-needed_tokens // block_size) + 1
    return max(2, min(int(budget // per_block), useful))


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        kv_caches: list[torch.Tensor],
        *,
        block_size: int,
        num_blocks: int,
        device: torch.device,
        seed: int = 0,
        forward: Callable | None = None,
        graphs: CUDAGraphRunner | None = None,
        compute_logits: Callable | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        """kv_caches: `allocate_kv_caches`'s, of num_blocks blocks. forward: what runs a step,
        with the model's signature (the compiled forward; None: the eager model). graphs: the
        CUDA graphs of that forward, replayed for the steps they fit (None: none).
        compute_logits: hidden rows -> logits (None: the model's; under tensor parallelism
        the one that has every rank score its part of the vocabulary).
        speculator: the proposer of draft tokens (runtime/speculative.py; None: none)."""
        self.model = loaded.model
        self.config = loaded.config
        self.block_size, self.num_blocks, self.device = block_size, num_blocks, device
        self.kv_caches = kv_caches
        self.forward = forward or self.model.forward
        # Tensor parallelism's gathered head, else the compiled forward's (a quantized
        # lm_head's compiled GEMV), else the model's.
        self.compute_logits = (
            compute_logits or getattr(forward, "compute_logits", None) or self.model.compute_logits
        )
        self.graphs = graphs
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}
        # Unseeded rows draw from one engine-wide generator, seeded once for reproducible runs.
        self.default_generator = torch.Generator(device=device).manual_seed(seed)
        self.eos_token_ids = list(loaded.config.eos_token_ids)
        self.counters = StepCounters()
        self.speculator = speculator

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        if self.speculator is not None:
            self.speculator.release(request_id)

    def propose(
        self, running: list, check: Callable | None = None, num_drafts: int | None = None
    ) -> list[tuple]:
        """Leave up to num_drafts (None: the config's k) draft tokens on the running requests
        that take them (no speculator: none); `check(request)` may cut them (a grammar's,
        StructuredOutputs.check_drafts). Returns the (request, room) asked."""
        if self.speculator is None:
            return []
        return self.speculator.propose(running, check, num_drafts)

    def generator(self, request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        gen = self.generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed + request.sibling_index)
            self.generators[request.request_id] = gen
        return gen

    def prepare(self, step: SchedulerOutput) -> PreparedInputs:
        # Host-side and vectorised with numpy: at batch 256 this runs every step, and per-row
        # torch calls cost more than the graph replay they feed (bench breakdown).
        scheduled = step.scheduled
        n_new = np.fromiter((it.num_new_tokens for it in scheduled), np.int64, len(scheduled))
        computed = np.fromiter(
            (it.num_computed_tokens for it in scheduled), np.int64, len(scheduled)
        )
        starts = np.zeros(len(scheduled) + 1, dtype=np.int32)
        np.cumsum(n_new, out=starts[1:])
        seq_lens = (computed + n_new).astype(np.int32)
        width = max(len(it.block_ids) for it in scheduled)
        tables = np.zeros((len(scheduled), width), dtype=np.int32)
        for row, it in enumerate(scheduled):
            tables[row, : len(it.block_ids)] = it.block_ids
        # Each new token's position, the row of its sequence, then its cache slot.
        owner = np.repeat(np.arange(len(scheduled)), n_new)
        positions = np.arange(int(starts[-1]), dtype=np.int64) - starts[owner] + computed[owner]
        bs = self.block_size
        slots = tables[owner, positions // bs].astype(np.int64) * bs + positions % bs
        ids = np.fromiter(
            (t for it in scheduled for t in it.new_token_ids), np.int64, int(starts[-1])
        )
        spec = _spec_rows(scheduled)
        if spec is not None:
            sample_rows = np.concatenate(
                [
                    np.arange(starts[i + 1] - len(it.draft_token_ids) - 1, starts[i + 1])
                    for i, it in enumerate(scheduled)
                    if it.samples
                ]
            )
        else:
            sample_rows = np.fromiter(
                (starts[i + 1] - 1 for i, it in enumerate(scheduled) if it.samples), np.int64
            )
        # A pending token is only ever the last of its request's chunk (the one before it was
        # computed by the step that sampled it).
        pending = [
            (int(starts[i + 1]) - 1, it.request.request_id)
            for i, it in enumerate(scheduled)
            if it.new_token_ids[-1] == PENDING_TOKEN
        ]
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots),
            block_tables=torch.from_numpy(tables),
            seq_lens=torch.from_numpy(seq_lens),
            query_start_loc=torch.from_numpy(starts),
        )
        # Host tensors: the graph runner copies them itself.
        return PreparedInputs(
            torch.from_numpy(ids),
            torch.from_numpy(positions),
            meta,
            sample_rows,
            pending,
            _prompt_rows(scheduled, starts),
            spec,
        )

    @torch.inference_mode()
    def forward_logits(
        self, step: SchedulerOutput, input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run a step and return the logits of its sampling rows [S, V], sampling nothing: a
        draft model's use. `input_ids` [T] on the device replaces the step's token ids."""
        inputs = self.prepare(step)
        ids = inputs.input_ids.to(self.device) if input_ids is None else input_ids
        hidden = self._run_model(ids, inputs.positions, inputs.meta)
        return self._logits(hidden, inputs.sample_rows)

    def _run_model(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        self.counters.steps += 1
        self.counters.tokens += input_ids.shape[0]
        if self.graphs is not None:
            hidden = self.graphs.run(input_ids, positions, meta)
            if hidden is not None:
                self.counters.graph_steps += 1
                return hidden
        dev = self.device
        meta = AttentionMetadata(
            *(
                t.to(dev, non_blocking=True)
                for t in (meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc)
            )
        )
        ids, pos = input_ids.to(dev, non_blocking=True), positions.to(dev, non_blocking=True)
        return self.forward(ids, pos, self.kv_caches, meta)

    def _input_ids(self, inputs: PreparedInputs, previous: InFlightStep | None) -> torch.Tensor:
        """The step's token ids: on the host when all are known, else on the device, pending
        ones read from the previous step's sampled tokens there (the host never waits)."""
        if inputs.pending and _all_pending_in_order(inputs, previous):
            # A decode step of exactly the requests the step ahead sampled, in its row order:
            # its ids are that step's tokens as they are, with no index copies or gathers (each
            # a separate device operation between two steps' graphs).
            return previous.token_ids
        if not inputs.pending:
            # The CUDA graphs stage host ids with the step's other inputs (one copy); the
            # eager forward copies them itself.
            return inputs.input_ids
        ids = inputs.input_ids.to(self.device, non_blocking=True)
        if previous is None or previous.token_ids is None:
            raise RuntimeError("a step has pending tokens but no step in flight samples them")
        rows = {r.request_id: i for i, r in enumerate(previous.sampling)}
        try:
            src = [rows[rid] for _, rid in inputs.pending]
        except KeyError as e:
            raise RuntimeError(
                f"request {e} has a pending token the last step did not sample"
            ) from None
        dst = torch.tensor([pos for pos, _ in inputs.pending], dtype=torch.int64)
        src_rows = torch.tensor(src, dtype=torch.int64)
        ids[dst.to(self.device, non_blocking=True)] = previous.token_ids[
            src_rows.to(self.device, non_blocking=True)
        ]
        return ids

    @torch.inference_mode()
    def launch(
        self,
        step: SchedulerOutput,
        previous: InFlightStep | None = None,
        *,
        defer_sampling: bool = False,
    ) -> InFlightStep:
        """Enqueue the step's model run, sampling and prompt scoring on the device and return
        at once; the results are copied to the host in the background (`collect` waits for
        them). `previous` is the step still in flight, whose sampled tokens feed this step's
        pending ones. With `defer_sampling` the step's logits wait for `sample` (structured
        output: the token masks need the previous step's tokens, which arrive meanwhile)."""
        if not step.scheduled:
            return InFlightStep(step, [], None, None, None)
        inputs = self.prepare(step)
        hidden = self._run_model(self._input_ids(inputs, previous), inputs.positions, inputs.meta)
        if self.speculator is not None:
            hidden = self.speculator.observe(step.scheduled, hidden)  # a head keeps features
        sampling = [item.request for item in step.scheduled if item.samples]
        if not sampling and inputs.prompt_rows is None:
            return InFlightStep(step, [], None, None, None)
        flight = InFlightStep(step, sampling, None, None, None, inputs.prompt_rows)
        flight.spec = inputs.spec
        if sampling:
            head = None
            if self.graphs is not None and len(inputs.sample_rows) == hidden.shape[0]:
                head = self.graphs.replay_head(hidden.shape[0])  # every row samples
            if head is not None:
                flight.logits, flight.argmax = head
            else:
                flight.logits = self._logits(hidden, inputs.sample_rows)
            if not defer_sampling:
                self._sample_into(flight, None)
        if inputs.prompt_rows is not None:
            scores = self._score_prompt(hidden, inputs.prompt_rows)
            flight.prompt_host = [t.to("cpu", non_blocking=True) for t in scores]
        if flight.logits is None:  # else `sample` records it, after its own copies
            flight.done = self._record()
        return flight

    @torch.inference_mode()
    def sample(self, flight: InFlightStep, token_bitmask: torch.Tensor | None = None) -> None:
        """Sample a step launched with defer_sampling (`token_bitmask`: the structured-output
        masks of its sampling rows, on the host) and start copying the results to the host."""
        self._sample_into(flight, token_bitmask)
        flight.done = self._record()

    def _sample_into(self, flight: InFlightStep, token_bitmask: torch.Tensor | None) -> None:
        if token_bitmask is None and all(map(_argmax_only, flight.sampling)):
            # Every row's token is its argmax: no SamplingBatch (a few host-to-device copies
            # a step) and no rejection sampling; the host accepts a greedy row's drafts.
            tokens = flight.argmax if flight.argmax is not None else greedy_argmax(flight.logits)
            flight.logits = flight.argmax = None
            flight.host = [tokens.to("cpu", non_blocking=True)]
            flight.host_verifies = flight.spec is not None
            flight.token_ids = None if flight.host_verifies else tokens
            return
        if flight.spec is not None:
            self._verify_into(flight, token_bitmask)
            return
        out = self._sample(flight.logits, flight.sampling, token_bitmask)
        flight.logits = None
        flight.token_ids, flight.host = out.token_ids, [out.token_ids.to("cpu", non_blocking=True)]
        if out.logprobs is not None:
            flight.host += [
                t.to("cpu", non_blocking=True)
                for t in (out.logprobs, out.top_logprob_ids, out.top_logprobs)
            ]

    def _verify_into(self, flight: InFlightStep, token_bitmask: torch.Tensor | None) -> None:
        """Verify a step's drafts: one SamplingBatch row a logits row, each with its
        request's parameters and the history it would have if the drafts before it are
        accepted (penalties, min_tokens), then rejection sampling."""
        spec, sampling = flight.spec, flight.sampling
        drafts = spec.draft_ids.tolist()
        params, prompts, outputs, generators, num_outputs = [], [], [], [], []
        draft_probs: list[tuple[int, torch.Tensor]] = []
        first = 0
        for request, count in zip(sampling, spec.counts, strict=True):
            own = drafts[first : first + count - 1]
            history = request.sampling_params.needs_output_history
            base = request.num_output_tokens + request.num_pending_tokens - 1
            generator = self.generator(request)
            for j in range(count):
                params.append(request.sampling_params)
                prompts.append(request.prompt_token_ids)
                outputs.append(request.output_token_ids + own[:j] if history else [])
                generators.append(generator)
                num_outputs.append(base + j)
            if count > 1 and not request.sampling_params.greedy:
                q = self.speculator.draft_probs(request.request_id, count - 1)
                if q is not None:
                    draft_probs.append((first, q))
                elif self.speculator.needs_draft_probs:
                    raise RuntimeError(
                        f"request {request.request_id!r} has sampled drafts without their "
                        "draft distribution"
                    )
            first += count
        logits = flight.logits
        if token_bitmask is not None and token_bitmask.shape[0] != logits.shape[0]:
            raise ValueError(
                f"a verifying step needs a mask a row ({logits.shape[0]}), got "
                f"{token_bitmask.shape[0]}: pass the step's drafts to StructuredOutputs.bitmask"
            )
        batch = SamplingBatch.build(
            params,
            prompts,
            outputs,
            generators,
            vocab_size=logits.shape[-1],
            device=self.device,
            eos_token_ids=self.eos_token_ids,
            num_output_tokens=num_outputs,
            token_bitmask=token_bitmask,
        )
        q = None
        if draft_probs:
            q = torch.zeros(logits.shape, dtype=torch.float32, device=self.device)
            for row, probs in draft_probs:
                q[row : row + probs.shape[0]] = probs
        draft_ids = torch.from_numpy(spec.draft_ids).to(self.device, non_blocking=True)
        out = rejection_sample(logits, batch, draft_ids, spec.counts, q, self.sampler)
        flight.logits = None
        flight.token_ids = out.last_token_ids
        tensors = [out.token_ids, out.num_accepted]
        if out.logprobs is not None:
            tensors += [out.logprobs, out.top_logprob_ids, out.top_logprobs]
        flight.host = [t.to("cpu", non_blocking=True) for t in tensors]

    def _record(self) -> torch.cuda.Event | None:
        """An event after the step's copies to the host (None on CPU, where they are done)."""
        if self.device.type != "cuda":
            return None
        done = torch.cuda.Event()
        done.record()
        return done

    def _logits(self, hidden: torch.Tensor, sample_rows: np.ndarray) -> torch.Tensor:
        if len(sample_rows) == hidden.shape[0]:
            return self.compute_logits(hidden)  # every token samples (rows 0..T-1)
        rows = torch.from_numpy(sample_rows).to(self.device, non_blocking=True)
        return self.compute_logits(hidden[rows])

    def _sample(
        self, logits: torch.Tensor, sampling: list, token_bitmask: torch.Tensor | None
    ) -> SamplerOutput:
        batch = SamplingBatch.build(
            [r.sampling_params for r in sampling],
            [r.prompt_token_ids for r in sampling],
            [r.output_token_ids for r in sampling],
            [self.generator(r) for r in sampling],
            vocab_size=logits.shape[-1],
            device=self.device,
            eos_token_ids=self.eos_token_ids,
            # The scheduler counted this step's own sample as pending already.
            num_output_tokens=[r.num_output_tokens + r.num_pending_tokens - 1 for r in sampling],
            token_bitmask=token_bitmask,
        )
        return self.sampler(logits, batch)

    def _score_prompt(self, hidden: torch.Tensor, plan: PromptRows) -> list[torch.Tensor]:
        """Logprob, rank and top-k of the prompt tokens `plan` names, PROMPT_LOGPROB_ROWS rows
        of logits at a time: [R] float32, [R] long, [R, k] long, [R, k] float32."""
        rows = torch.from_numpy(plan.rows).to(self.device, non_blocking=True)
        targets = torch.from_numpy(plan.targets).to(self.device, non_blocking=True)
        n = PROMPT_LOGPROB_ROWS
        parts = [
            prompt_token_logprobs(
                self.compute_logits(hidden[rows[a : a + n]]), targets[a : a + n], plan.k
            )
            for a in range(0, len(plan.rows), n)
        ]
        return [torch.cat(column) for column in zip(*parts, strict=True)]

    def collect(self, flight: InFlightStep) -> RunnerOutput:
        """Wait for a launched step's results (the step's one device-to-host sync)."""
        if not flight.sampling and flight.prompt_rows is None:
            return RunnerOutput({}, {})
        if flight.done is not None:
            waited = time.perf_counter()
            flight.done.synchronize()
            self.counters.device_wait_s += time.perf_counter() - waited
        if flight.spec is not None:
            sampled, logprobs = _verified(flight)
        else:
            sampled, logprobs = _sampled(flight)
        prompt = {}
        if flight.prompt_rows is not None:
            prompt = _prompt_entries(flight.prompt_rows, flight.prompt_host)
        return RunnerOutput(sampled, logprobs, prompt)

    def execute(self, step: SchedulerOutput) -> RunnerOutput:
        """Run one step synchronously (launch, then collect)."""
        return self.collect(self.launch(step))


def _spec_rows(scheduled: list[ScheduledRequest]) -> SpecRows | None:
    if not any(it.draft_token_ids for it in scheduled):
        return None
    counts, draft_ids = [], []
    for it in scheduled:
        if it.samples:
            counts.append(len(it.draft_token_ids) + 1)
            draft_ids += [*it.draft_token_ids, -1]
    return SpecRows(counts, np.asarray(draft_ids, dtype=np.int64))


def _sampled(flight: InFlightStep) -> tuple[dict, dict]:
    """One token a sampling request (and its logprobs, if asked)."""
    sampled: dict[str, list[int]] = {}
    logprobs: dict[str, list[TokenLogprobs]] = {}
    if flight.sampling:
        tokens = flight.host[0].tolist()
        sampled = {r.request_id: [t] for r, t in zip(flight.sampling, tokens, strict=True)}
    if flight.sampling and len(flight.host) > 1:
        chosen, top_ids, top_vals = (t.tolist() for t in flight.host[1:])
        for i, r in enumerate(flight.sampling):
            k = r.sampling_params.logprobs
            if k is None:
                continue
            top = list(zip(top_ids[i][:k], top_vals[i][:k], strict=True))
            logprobs[r.request_id] = [TokenLogprobs(tokens[i], chosen[i], top)]
    return sampled, logprobs


def _argmax_only(request) -> bool:
    """Whether a sampling request's token is its logits' argmax: greedy, nothing that changes
    or reports the logits, min_tokens reached (the scheduler counts this step's sample as
    pending already)."""
    params = request.sampling_params
    return params.argmax_only and (
        request.num_output_tokens + request.num_pending_tokens > params.min_tokens
    )


def _host_verified(flight: InFlightStep) -> dict[str, list[int]]:
    """Greedy verification from every row's argmax: a request keeps its drafts while each
    equals the argmax of the row before it, then that row's argmax (rejection_sample's
    greedy rows)."""
    tokens, drafts = flight.host[0].tolist(), flight.spec.draft_ids.tolist()
    sampled, first = {}, 0
    for request, count in zip(flight.sampling, flight.spec.counts, strict=True):
        n = 0
        while n < count - 1 and drafts[first + n] == tokens[first + n]:
            n += 1
        sampled[request.request_id] = tokens[first : first + n + 1]
        first += count
    return sampled


def _verified(flight: InFlightStep) -> tuple[dict, dict]:
    """A verifying step's tokens: each request's accepted drafts and the token after them,
    with each one's own logprobs (its row's), if asked."""
    if flight.host_verifies:
        return _host_verified(flight), {}
    tokens, accepted = (t.tolist() for t in flight.host[:2])
    scores = [t.tolist() for t in flight.host[2:]]
    sampled: dict[str, list[int]] = {}
    logprobs: dict[str, list[TokenLogprobs]] = {}
    first = 0
    for request, count, n in zip(flight.sampling, flight.spec.counts, accepted, strict=True):
        sampled[request.request_id] = tokens[first : first + n + 1]
        k = request.sampling_params.logprobs
        if scores and k is not None:
            chosen, top_ids, top_vals = scores
            entries = []
            for r in range(first, first + n + 1):
                top = list(zip(top_ids[r][:k], top_vals[r][:k], strict=True))
                entries.append(TokenLogprobs(tokens[r], chosen[r], top))
            logprobs[request.request_id] = entries
        first += count
    return sampled, logprobs
