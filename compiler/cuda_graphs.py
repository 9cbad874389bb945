"""CUDA graphs of the whole model forward, one per padded token count. All of it lives here.

Why whole-model graphs for every batch, not only decode: our paged-attention kernel reads
every per-step quantity (which sequence a token belongs to, how long its context is) from
device memory and sizes its grid from tensor shapes alone, so a graph captured for T tokens
replays correctly for any mix of prefill chunks and decodes that fits in T tokens and
`max_num_seqs` sequences. Batches larger than the largest captured size run the compiled
pieces without a graph.

Persistent buffers: the token-indexed inputs (ids, positions, slot mapping) are sized for the
largest capture, the sequence-indexed ones (block tables, seq_lens, query_start_loc) for
`max_num_seqs`; every graph reads prefixes/whole of the same buffers. Padding is explicit
(`prepare_for_replay`): padded tokens write their KV into scratch block 0 and belong to no
sequence (query_start_loc repeats the real token count), padded sequences have length 0.
Graphs are captured largest first into one shared memory pool, so the pool is the size of
the largest graph's activations, not the sum.

Short-context graphs: at small batches paged attention splits each sequence's keys among up to
33 programs a KV head, a count fixed at capture by the block table's width (max_model_len),
and at short contexts all but one or two of them find no keys yet still launch, and the
partials are combined. A launch on a table at most `UNSPLIT_KEYS` wide runs unsplit (where
its config sets that bound: one-token launches on CUDA). So for each size where that
differs, a second graph is captured on the first columns of the same block-table buffer,
and a step whose widest table fits replays it (`short_table_widths`). At batch 1,
Llama-3-8B on the H200, contexts 33-160: 247.5 / 247.3 tok/s against 245.9 / 245.9 with the
wide table's splits (docs/compiler.md, section 6, item 10).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from compile_engine.compiler.compiled_model import as_decode_rows
from compile_engine.kernels_generated.tuning import KernelConfig
from compile_engine.models.layers import AttentionMetadata

log = logging.getLogger(__name__)


# A graph's (capture size, block-table width or None: the full table, sequence slots or None:
# max_num_seqs).
GraphKey = tuple[int, int | None, int | None]

MAX_GRAPH_TOKENS = 2048  # the largest mixed batch that replays a graph, by default


def default_capture_sizes(
    max_num_seqs: int, max_num_batched_tokens: int, max_graph_tokens: int | None = None
) -> list[int]:
    """1, 2, 4, 8, then steps of 4 to 16, of 8 to 64, of 16 to 128, of 32 to 512 and of 256
    above to max_graph_tokens (and it), within the token budget: every decode batch (up to
    512 sequences) and mixed batches up to max_graph_tokens replay a graph. With serve's
    defaults (256 sequences, 2,048 tokens) that is 34 graphs, every step of a serving run:
    steps with prompt chunks run 768-2,048 tokens, and launched piece by piece from the host
    they cost serving a sixth of its throughput on the H200 (`serve-768-graphs-*.json`).
    `--max-cuda-graph-tokens` lowers the bound (512: the 28 sizes up to 512 of before);
    None: MAX_GRAPH_TOKENS."""
    max_graph_tokens = max_graph_tokens or MAX_GRAPH_TOKENS
    sizes = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128]
    sizes += list(range(160, 513, 32))
    sizes += list(range(768, max_graph_tokens + 1, 256))
    limit = min(max(max_graph_tokens, max_num_seqs), max_num_batched_tokens)
    sizes = [s for s in sizes if s <= limit]
    top = min(max_graph_tokens, max_num_batched_tokens)
    return sizes + [top] if top > max(sizes[-1], 512) else sizes


# The passes that lower attention to kernels_generated/paged_attention/'s kernel, whose split
# count follows the block table's width.
PAGED_ATTENTION_PASSES = ("paged_attention_triton", "rotary_into_attention")


def short_table_widths(
    match_counts: dict[str, int],
    kernel_config: KernelConfig,
    num_kv_heads: int,
    capture_sizes: list[int],
    block_size: int,
    max_blocks_per_seq: int,
    device: torch.device,
) -> dict[int, int]:
    """For each capture size whose paged attention runs unsplit on a narrower block table than
    the full one (`unsplit_context`), that table's width in blocks: the runner captures a
    second graph there. Empty when the compiled forward (its passes' `match_counts`) has no
    paged-attention kernel; the split policy is the kernel config's."""
    if not any(match_counts.get(name) for name in PAGED_ATTENTION_PASSES):
        return {}
    # Imported by those passes already (here only when one of them matched).
    from compile_engine.kernels_generated.paged_attention import unsplit_context

    widths = {}
    for size in capture_sizes:
        blocks = unsplit_context(kernel_config, size, num_kv_heads, device) // block_size
        if 0 < blocks < max_blocks_per_seq:
            widths[size] = blocks
    return widths


def prefill_rows(
    match_counts: dict[str, int],
    kernel_config: KernelConfig,
    capture_sizes: list[int],
    max_num_seqs: int,
) -> dict[int, int]:
    """For each capture size whose full graph runs paged attention's single-token kernel even
    on a prefill-heavy step, the sequence slots of its prefill graph, captured beside it.

    The kernel variant is chosen from shapes (`choose_tiled`: tokens >= min tokens per
    sequence x sequence slots), and a graph's slots are max_num_seqs, so below 2 x
    max_num_seqs tokens every captured step ran the single-token kernel: one program per
    query token, each reading its whole context. A 416-token prompt took 31.8 ms there
    against 13.1 ms for 512 tokens (tiled), and 416 tokens after a cached 3,680-token prefix
    58.7 ms (H200, Llama-3-8B shape, `bench prefix --sweep`, b1428e0). The prefill graph
    holds size // min tokens per sequence slots, so the same shapes choose the tiled kernel
    (with the single-token kernel for the batch's one-token sequences); a step replays it
    when its own shapes would choose tiled, which also fits it in those slots. Sizes from
    `attention.prefill_graph_min_tokens` (below it a short chunk after a long cached prefix
    runs faster on the single-token kernel's splits). Empty when the compiled forward has no
    paged-attention kernel."""
    if not any(match_counts.get(name) for name in PAGED_ATTENTION_PASSES):
        return {}
    from compile_engine.kernels_generated.paged_attention import choose_tiled

    per_seq = kernel_config.attention.tiled_min_tokens_per_seq
    rows = {}
    least = kernel_config.attention.prefill_graph_min_tokens
    for size in (s for s in capture_sizes if s >= least):
        slots = min(size // per_seq, max_num_seqs)
        tiled = choose_tiled(kernel_config, size, max_num_seqs)
        if slots >= 1 and not tiled and choose_tiled(kernel_config, size, slots):
            rows[size] = slots
    return rows


def sequence_slots(max_num_seqs: int, kernel_config: KernelConfig, decode_rows: bool) -> int:
    """The graphs' sequence slots: max_num_seqs, and with decode rows at least a row a token
    of a step that replays as rows, so that an engine of fewer sequences (batch 1) replays its
    verification steps as rows too (padded slots cost nothing)."""
    if not decode_rows:
        return max_num_seqs
    return max(max_num_seqs, kernel_config.attention.write_first_max_tokens)


class CUDAGraphRunner:
    def __init__(
        self,
        forward: Callable,
        kv_caches: list[torch.Tensor],
        *,
        capture_sizes: list[int],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
        short_widths: dict[int, int] | None = None,
        prefill_rows: dict[int, int] | None = None,
        kernel_config: KernelConfig | None = None,
        decode_rows: bool = False,
    ) -> None:
        """short_widths: capture size -> block-table width (blocks) of its short-context graph
        (`short_table_widths`); prefill_rows: capture size -> sequence slots of its prefill
        graph (`prefill_rows`, whose kernel choice `kernel_config` makes); none by default.
        decode_rows: a step of at most `attention.write_first_max_tokens` tokens (the kernel
        config's) with a sequence of several replays as one-token rows (`as_decode_rows`),
        which the forward's paged attention supports by writing the step's K/V before it
        reads (its launches of that many tokens do)."""
        self.forward, self.kv_caches = forward, kv_caches
        self.decode_rows_max = 0
        if decode_rows:
            if kernel_config is None:
                raise ValueError("decode rows need the kernel config whose bound they follow")
            self.decode_rows_max = kernel_config.attention.write_first_max_tokens
            max_num_seqs = sequence_slots(max_num_seqs, kernel_config, decode_rows)
        self.sizes = sorted(set(capture_sizes))
        self.short_widths = {
            size: width for size, width in (short_widths or {}).items() if size in self.sizes
        }
        self.prefill_rows = {
            size: rows for size, rows in (prefill_rows or {}).items() if size in self.sizes
        }
        if self.prefill_rows and kernel_config is None:
            raise ValueError("prefill graphs need the kernel config whose choice they follow")
        self.kernel_config = kernel_config
        self._choose_tiled = None  # paged attention's choice, imported once (not a step)
        if self.prefill_rows:
            from compile_engine.kernels_generated.paged_attention import choose_tiled

            self._choose_tiled = choose_tiled
        self.max_num_seqs = max_num_seqs
        max_tokens = self.sizes[-1]
        # The token-indexed inputs are the rows of one buffer, the sequence lengths and query
        # starts two parts of another (the starts 16-byte aligned): each is filled on the host
        # and copied in one go, as is a small batch's block table (`_Staging`). A decode
        # step's ids are on the device already (the last step's samples): one more copy.
        self._tokens = torch.zeros(3, max_tokens, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping = self._tokens.unbind(0)
        starts = -(-max_num_seqs // 4) * 4
        self._lens = torch.zeros(starts + max_num_seqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = self._lens[:max_num_seqs]
        self.query_start_loc = self._lens[starts:]
        self._starts = starts
        self.block_tables = torch.zeros(
            max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=device
        )
        self._stages = [_Staging(self, torch.device(device)) for _ in range(2)]
        self._turn = 0
        # Keyed by (size, table width in blocks or None for the full table, sequence slots
        # or None for max_num_seqs).
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}
        self.last_key: GraphKey | None = None  # the graph this step replayed (None: none)
        # Graphs of the lm_head and each row's argmax over a graph's output (`capture_heads`).
        self.heads: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self.warmup_seconds = 0.0  # host time of the warm-up calls (part of capture_seconds)
        self.pool_bytes = 0

    @classmethod
    def for_compiled(
        cls,
        compiled,
        kv_caches: list[torch.Tensor],
        *,
        capture_sizes: list[int],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        num_kv_heads: int,
        device: torch.device,
    ) -> CUDAGraphRunner:
        """The runner of a CompiledForward whose block tables span max_model_len, with the
        short-context graphs its passes call for: what the build's warm-up and the engine's
        capture both make, so that they compile and capture the same graphs."""
        max_blocks = -(-max_model_len // block_size)
        counts, kernel_config = compiled.pass_manager.match_counts, compiled.config.kernel
        widths = short_table_widths(
            counts, kernel_config, num_kv_heads, capture_sizes, block_size, max_blocks, device
        )
        decode_rows = any(counts.get(name) for name in PAGED_ATTENTION_PASSES)
        slots = sequence_slots(max_num_seqs, kernel_config, decode_rows)
        rows = prefill_rows(counts, kernel_config, capture_sizes, slots)
        return cls(
            compiled, kv_caches, capture_sizes=capture_sizes, max_num_seqs=max_num_seqs,
            max_blocks_per_seq=max_blocks, device=device, short_widths=widths,
            prefill_rows=rows, kernel_config=kernel_config, decode_rows=decode_rows,
        )  # fmt: skip

    def _keys(self) -> list[GraphKey]:
        """Every graph's key, largest size first; a size's full graph, then its short-context
        one, then its prefill one."""
        keys = []
        for size in reversed(self.sizes):
            keys.append((size, None, None))
            if size in self.short_widths:
                keys.append((size, self.short_widths[size], None))
            if size in self.prefill_rows:
                keys.append((size, None, self.prefill_rows[size]))
        return keys

    def _meta(
        self, size: int, width: int | None = None, rows: int | None = None
    ) -> AttentionMetadata:
        rows = self.max_num_seqs if rows is None else rows
        tables = self.block_tables if width is None else self.block_tables[:, :width]
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=tables[:rows],
            seq_lens=self.seq_lens[:rows],
            query_start_loc=self.query_start_loc[: rows + 1],
        )

    def prepare_for_capture(self) -> None:
        """An all-padding batch: the kernels run their launch path and touch only block 0."""
        self._tokens.zero_()
        self._lens.zero_()
        self.block_tables.zero_()

    def _warm_up(self, key: GraphKey) -> None:
        start = time.perf_counter()
        args = (self.input_ids[: key[0]], self.positions[: key[0]], self.kv_caches)
        self.forward(*args, self._meta(*key))
        self.warmup_seconds += time.perf_counter() - start

    @torch.inference_mode()
    def warm_up(self, progress: Callable[[str, int, int | None], None] | None = None) -> None:
        """Run the forward once at every capture size on the all-padding batch, without
        graphs. A build calls this: a kernel's first launch at a size can compile a Triton
        specialisation (paged attention picks its split count and kernel variant from the
        token count and the table's width), and compiled here it lands in the artifact's
        Triton cache, so that the capture at serve time only loads it. `progress` hears
        ("warm-up", sizes done, sizes)."""
        self.prepare_for_capture()
        keys = self._keys()
        for done, key in enumerate(keys, 1):
            self._warm_up(key)
            if progress is not None:
                progress("warm-up", done, len(keys))
        torch.cuda.synchronize()

    @torch.inference_mode()
    def capture(self, progress: Callable[[str, int, int | None], None] | None = None) -> None:
        """Capture every graph, largest first; `progress` hears ("cuda graphs", done, all)."""
        self.prepare_for_capture()
        start = time.perf_counter()
        before = torch.cuda.memory_reserved()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        keys = self._keys()
        with torch.cuda.stream(stream):
            for done, key in enumerate(keys, 1):
                self._warm_up(key)  # lazy init (kernel loads, cuBLAS) outside the graph
                size = key[0]
                args = (self.input_ids[:size], self.positions[:size], self.kv_caches)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    out = self.forward(*args, self._meta(*key))
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[key], self.outputs[key] = graph, out
                if progress is not None:
                    progress("cuda graphs", done, len(keys))
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.pool_bytes = torch.cuda.memory_reserved() - before
        log.info(
            "captured %d CUDA graphs (%d..%d tokens, %d of them short-context, %d prefill) "
            "in %.1f s (%.1f s of it warm-up), %.2f GiB",
            len(self.graphs),
            self.sizes[0],
            self.sizes[-1],
            len(self.short_widths),
            len(self.prefill_rows),
            self.capture_seconds,
            self.warmup_seconds,
            self.pool_bytes / 2**30,
        )

    @torch.inference_mode()
    def capture_heads(
        self,
        head: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        max_rows: int,
    ) -> None:
        """Capture `head` (hidden rows -> their logits and each row's argmax: the runtime's
        lm_head and greedy choice) over the output of every graph of at most `max_rows`
        tokens but the prefill ones. A step whose every row samples (decode, verification)
        replays it (`replay_head`) instead of launching the lm_head and argmax kernels from
        the host, three Triton launches a step."""
        keys = self.head_keys(max_rows)
        if not keys:
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for key in keys:
                hidden = self.outputs[key]
                head(hidden)  # lazy init (kernel loads) outside the graph
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    logits, tokens = head(hidden)
                self.heads[key] = (graph, logits, tokens)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def head_keys(self, max_rows: int) -> list[GraphKey]:
        """The graphs a head follows: up to max_rows tokens, not prefill graphs (whose steps
        sample a row a sequence, not every row)."""
        return [key for key in self._keys() if key[0] <= max_rows and key[2] is None]

    def replay_head(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The logits [num_rows, V] and argmax [num_rows] of this step's graph output, by its
        head graph's replay; None when this step replayed no graph or one without a head."""
        entry = self.heads.get(self.last_key) if self.last_key is not None else None
        if entry is None:
            return None
        graph, logits, tokens = entry
        graph.replay()
        return logits[:num_rows], tokens[:num_rows]

    def _key(self, size: int, num_tokens: int, num_seqs: int, width: int) -> GraphKey:
        rows = self.prefill_rows.get(size)
        tiled = rows is not None and num_seqs <= rows
        if tiled and self._choose_tiled(self.kernel_config, num_tokens, num_seqs):
            return (size, None, rows)
        short = self.short_widths.get(size)
        return (size, short if short is not None and width <= short else None, None)

    def padded_size(self, num_tokens: int, num_seqs: int) -> int | None:
        if num_seqs > self.max_num_seqs or num_tokens > self.sizes[-1]:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, num_tokens)]

    def prepare_for_replay(
        self,
        size: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        n, b = input_ids.shape[0], meta.seq_lens.shape[0]
        width = meta.block_tables.shape[1]
        stage = self._stages[self._turn]
        self._turn ^= 1
        stage.wait()
        tokens, lens, starts = stage.tokens_np, stage.lens_np, self._starts
        on_host = input_ids.device.type == "cpu"
        if on_host:
            tokens[0, :n] = input_ids.numpy()
        tokens[1, :n] = positions.numpy()
        tokens[2, :n] = meta.slot_mapping.numpy()
        tokens[2, n:size] = 0
        lens[:b] = meta.seq_lens.numpy()
        lens[b:starts] = 0
        lens[starts : starts + b + 1] = meta.query_start_loc.numpy()
        lens[starts + b + 1 :] = n
        self._tokens.copy_(stage.tokens, non_blocking=True)
        if not on_host:  # after the rows' copy, over its stale first row
            self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self._lens.copy_(stage.lens, non_blocking=True)
        # Columns past `width` may hold an earlier step's blocks: the kernel reads only the
        # first ceil(seq_len / block_size) entries of a row, all of which are written here.
        if b <= stage.table_rows:
            stage.tables_np[:b, :width] = meta.block_tables.numpy()
            self.block_tables[:b].copy_(stage.tables[:b], non_blocking=True)
        else:
            self.block_tables[:b, :width].copy_(meta.block_tables, non_blocking=True)
        stage.record()

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """Replay the graph of the smallest captured size that fits: its prefill graph when the
        step's own shapes choose the tiled attention kernel, else its short-context graph when
        the step's block table is no wider than that graph's; None if no size fits."""
        n, num_seqs = input_ids.shape[0], meta.seq_lens.shape[0]
        self.last_key = None
        if num_seqs < n <= self.decode_rows_max:
            # A speculative verification step (1 + k tokens a sequence) as one-token rows:
            # each row attends with the splits and key tiles of the one-token decode of the
            # same token, so its logits have the decode's bits and greedy speculation stays
            # lossless in bf16 (issue 33). None where a sequence has more tokens.
            rows = as_decode_rows(meta, n)
            if rows is not None:
                meta, num_seqs = rows, n
        size = self.padded_size(n, num_seqs)
        if size is None:
            return None
        self.prepare_for_replay(size, input_ids, positions, meta)
        key = self._key(size, n, num_seqs, meta.block_tables.shape[1])
        self.last_key = key
        self.graphs[key].replay()
        return self.outputs[key][:n]


# A small batch's block table is staged too (one contiguous copy of its full rows) while
# those rows are at most this many bytes; a larger one is copied as its used columns.
STAGED_TABLE_BYTES = 64 << 10


class _Staging:
    """Host copies of a step's graph inputs, pinned on CUDA so that each is one asynchronous
    copy (from pageable memory a copy is staged by the driver first: ~0.13 ms for a step's
    inputs on the H200 host, SmolLM2). The runner has two and takes them in turn; one is
    refilled only once the copies from its last use have run (`wait`)."""

    def __init__(self, graphs: CUDAGraphRunner, device: torch.device) -> None:
        cuda = device.type == "cuda"

        def host(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, pin_memory=cuda)

        rows, blocks = graphs.block_tables.shape
        self.tokens = host(*graphs._tokens.shape, dtype=torch.int64)
        self.lens = host(graphs._lens.shape[0], dtype=torch.int32)
        self.table_rows = min(rows, max(1, STAGED_TABLE_BYTES // (4 * blocks)))
        self.tables = host(self.table_rows, blocks, dtype=torch.int32)
        self.tokens_np, self.lens_np = self.tokens.numpy(), self.lens.numpy()
        self.tables_np = self.tables.numpy()
        self._done = torch.cuda.Event() if cuda else None

    def wait(self) -> None:
        if self._done is not None:
            self._done.synchronize()

    def record(self) -> None:
        if self._done is not None:
            self._done.record()
