"""Capture the model's forward once with Dynamo and serve every later call from that graph.

The token dimension (and the batch dimensions of the attention metadata) are dynamic. After
the first capture no guard is evaluated: every guard is dropped through torch.compile's
`guard_filter_fn`, so a step costs no guard checks and can never silently recompile. The
graph is valid for every token count because each dynamic dimension is symbolic in it; the
one assumption Dynamo makes (size >= 2) is covered by the tests that decode one token.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from compile_engine.compiler.backend import PiecewiseBackend, is_decode_attention
from compile_engine.compiler.config import CompileConfig, apply_inductor_settings
from compile_engine.kernels_generated.int_linear_cpu import Q8Logits
from compile_engine.kernels_generated.paged_attention_cpu import paged_attention_decode_cpu
from compile_engine.kernels_generated.vnni_linear_cpu import VnniLogits
from compile_engine.models import vocabulary
from compile_engine.models.layers import AttentionMetadata, Embedding, LMHead
from compile_engine.models.quant import QuantEmbedding, QuantLinear
from compile_engine.passes.base import PassContext
from compile_engine.passes.manager import PassManager
from compile_engine.passes.registry import select

log = logging.getLogger(__name__)


def _drop_all_guards(guards) -> list[bool]:
    return [False for _ in guards]


# torch._dynamo.utils.counters entries that say what the caches did during a capture.
_CACHE_COUNTERS = {
    "aot_autograd_hits": ("aot_autograd", "autograd_cache_hit"),
    "aot_autograd_misses": ("aot_autograd", "autograd_cache_miss"),
    "aot_autograd_bypasses": ("aot_autograd", "autograd_cache_bypass"),
    "fx_graph_hits": ("inductor", "fxgraph_cache_hit"),
    "fx_graph_misses": ("inductor", "fxgraph_cache_miss"),
}


def _cache_counts() -> dict[str, int]:
    counters = torch._dynamo.utils.counters
    return {name: counters[group][key] for name, (group, key) in _CACHE_COUNTERS.items()}


def references_hash() -> str:
    """Hash of the source files that define our op references (models/ops.py, moe.py and mla.py,
    gathered by models/vocabulary.py), which is all of ours that their traces depend on: they
    call torch and their own modules only."""
    h = hashlib.sha256()
    for name in sorted({ref.__module__ for _, ref in vocabulary.OPS.values()}):
        h.update(Path(sys.modules[name].__file__).read_bytes())
    return h.hexdigest()[:16]


def cacheable_references() -> dict[str, str]:
    """Our op references, vouched for to AOTAutograd's cache, keyed by their source.

    lower_to_reference leaves calls of plain Python functions (`models.ops.rms_norm_ref`, ...)
    in every piece, and AOTAutograd's cache refuses a graph calling a function it cannot vouch
    for ("Bypassing autograd cache due to: Unsupported call_function target"): each load then
    re-ran AOT tracing of every piece before Inductor's FX-graph cache hit (1.1 of 2.0 s of
    piece loading, tiny 32-layer Llama on the CPU). Inductor's `unsafe_marked_cacheable_
    functions` vouches for functions by name, and its values enter both caches' keys: keyed
    by the hash of the files defining the references, an edit of one misses the caches
    instead of serving code traced from the old one. (Only those files: keyed by all engine
    code, every edit anywhere would recompile every piece of the shared development cache.)
    """
    salt = f"compile-engine:{references_hash()}"
    marked = {f"{ref.__module__}.{ref.__name__}": salt for _, ref in vocabulary.OPS.values()}
    # Kernel lowerings that are plain functions inlined into a graph (the CPU decode graph's
    # attention), keyed by their own file.
    for fn in INLINED_KERNELS:
        source = Path(sys.modules[fn.__module__].__file__).read_bytes()
        marked[f"{fn.__module__}.{fn.__name__}"] = hashlib.sha256(source).hexdigest()[:16]
    return marked


INLINED_KERNELS = (paged_attention_decode_cpu,)

_copies = itertools.count()


def _own_code_object(method):
    """The bound method again, but with a code object of its own. Dynamo keeps compiled
    graphs per code object and our entries carry no guards, so two models in one process
    (tests, a build then a load) must never share one: the second would run the first's
    graph."""
    fn = method.__func__
    code = fn.__code__
    name = f"{code.co_name}_ce{next(_copies)}"
    copy = types.FunctionType(
        code.replace(co_name=name, co_qualname=name),
        fn.__globals__,
        name,
        fn.__defaults__,
        fn.__closure__,
    )
    return types.MethodType(copy, method.__self__)


def dummy_batch(
    vocab_size: int, device: torch.device, num_tokens: int = 7
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A mixed batch (one prefill chunk, one decode) whose dynamic sizes are all distinct and
    >= 2, writing only to the scratch block 0."""
    seq_lens = [num_tokens - 1 + 3, 1 + 4]
    starts = [0, num_tokens - 1, num_tokens]
    ids = torch.arange(num_tokens, device=device) % vocab_size
    positions = torch.arange(num_tokens, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        block_tables=torch.zeros(2, 4, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
    )
    return ids, positions, meta


def dummy_decode_batch(
    vocab_size: int, device: torch.device, num_seqs: int = 5
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A decode step (one new token a sequence) for the decode graph's capture: its dynamic
    sizes (sequences, table width) distinct and >= 2, writing only to the scratch block 0."""
    positions = torch.arange(4, 4 + num_seqs, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(num_seqs, dtype=torch.int64, device=device),
        block_tables=torch.zeros(num_seqs, 2, dtype=torch.int32, device=device),
        seq_lens=(positions + 1).to(torch.int32),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=device),
    )
    return torch.arange(num_seqs, device=device) % vocab_size, positions, meta


def _compile_forward(model: nn.Module, backend: PiecewiseBackend, dynamic: bool | None = False):
    """model.forward under torch.compile with `backend`: one graph, every guard dropped.
    `dynamic=None` lets the capture duck-size the dims it leaves unmarked (see capture)."""
    return torch.compile(
        _own_code_object(model.forward),
        backend=backend,
        fullgraph=True,
        dynamic=dynamic,
        options={"guard_filter_fn": _drop_all_guards},
    )


# A step whose sequences all have at most this many new tokens (speculative verification: 1 + k)
# runs the CPU decode graph with a row a token (`as_decode_rows`).
DECODE_ROWS_MAX_TOKENS = 16


def as_decode_rows(meta: AttentionMetadata, num_tokens: int) -> AttentionMetadata | None:
    """The step as one row a token, for the CPU decode graph (CPU tensors: reading them costs
    no sync), or None when a sequence has more than DECODE_ROWS_MAX_TOKENS new tokens (a
    prompt chunk: the pieces' prefill attention is the faster there). Token i of a sequence
    with seq_len L and Q new tokens becomes a row of seq_len L - Q + 1 + i over the same block
    table: the keys it sees under the causal mask. The decode attention writes every row's K/V
    before any row reads, so a row finds the step's earlier tokens in the cache. A speculative
    verification step (1 + k tokens a sequence) then costs about a decode step of that many
    sequences, not the 31 pieces' (SmolLM2, issue 33)."""
    if meta.query_start_loc.device.type != "cpu":
        return None
    starts = meta.query_start_loc.numpy()  # numpy: a verification step's host work
    if starts[-1] != num_tokens:
        return None
    q_lens = np.diff(starts)
    if q_lens.max() > DECODE_ROWS_MAX_TOKENS:
        return None
    seq_of = np.repeat(np.arange(len(q_lens)), q_lens)  # [T]
    # Row i of a sequence: its length less the tokens after it.
    lens = meta.seq_lens.numpy()
    seq_lens = lens[seq_of] - (starts[1:][seq_of] - np.arange(num_tokens)) + 1
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        block_tables=torch.from_numpy(meta.block_tables.numpy()[seq_of]),
        seq_lens=torch.from_numpy(seq_lens.astype(lens.dtype)),
        query_start_loc=torch.arange(num_tokens + 1, dtype=meta.query_start_loc.dtype),
    )


class CompiledForward:
    """Drop-in replacement for `model.forward(input_ids, positions, kv_caches, meta)`."""

    def __init__(self, model: nn.Module, config: CompileConfig, dtype: torch.dtype) -> None:
        self.config = config
        self.cache_dir = apply_inductor_settings(config)
        self.pass_manager = PassManager(
            select(config.passes), PassContext(config.target, dtype, config.kernel)
        )
        self.backend = PiecewiseBackend(self.pass_manager)
        self.model = model
        self._fn = _compile_forward(model, self.backend)
        # On the CPU decode steps run a graph of their own in which attention is inlined
        # (passes/paged_attention_cpu.py): one compiled call a step instead of 31 pieces and
        # 30 eager attention calls, whose dispatch was ~40% of a batch-1 step (issue 29).
        self._decode_fn = None
        self.decode_backend: PiecewiseBackend | None = None
        if config.target == "cpu":
            ctx = PassContext(config.target, dtype, config.kernel, decode_only=True)
            self.decode_backend = PiecewiseBackend(
                PassManager(select(config.passes), ctx), outline_between=is_decode_attention
            )
            self._decode_fn = _compile_forward(model, self.decode_backend, dynamic=None)
        self.capture_seconds = 0.0
        # A quantized tied lm_head (GGUF Q8_0) on the CPU: its GEMV compiled apart, since the
        # lm_head runs outside the graph (kernels_generated/int_linear_cpu.py says why).
        self._logits = None
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if (
            config.target == "cpu"
            and isinstance(embed, QuantEmbedding)
            and getattr(model, "lm_head", True) is None
            and embed.quant_scheme.weight == "int8"
        ):
            # Our VNNI kernel where the decoder's linears run it too (the loader chose the
            # vnni_cpu layout for this CPU), else the compiled Inductor GEMV.
            vnni = any(
                isinstance(m, QuantLinear) and m.quant_scheme.layout == "vnni_cpu"
                for m in model.modules()
            )
            use_vnni = vnni and VnniLogits.runs(embed)
            self._logits = VnniLogits(embed) if use_vnni else Q8Logits(embed)
        # The lm_head runs outside the graph. On CUDA a plain one takes the skinny GEMM
        # table's choice as the graph's linears do: a table written with `bench gemm
        # --shared-rows` computes each row of a verification step's logits as the one-row
        # decode does (issue 33). Vocabulary-parallel and quantized heads keep their own.
        head = getattr(model, "lm_head", None)
        if head is None:
            head = getattr(getattr(model, "model", None), "embed_tokens", None)
        self._head = head if type(head) in (LMHead, Embedding) else None
        self._head_linear = None
        if self._head is not None and config.target != "cpu":
            # Imported only here: triton is no import of a CPU engine's.
            from compile_engine.kernels_generated.skinny_gemm import tuned_linear

            self._head_linear = tuned_linear
        # What Inductor's caches did during capture (counts of pieces): at load every piece
        # should be an AOTAutograd hit, which implies an FX-graph hit and no compile.
        self.cache_stats: dict[str, int] = {}

    def capture(
        self,
        kv_caches: list[torch.Tensor],
        before_first_run: Callable[[], None] | None = None,
        progress: Callable[[str, int, int | None], None] | None = None,
    ) -> None:
        """Trace and compile now, on a dummy batch, so that no request pays for it. Tracing and
        compiling need the parameters' shapes and addresses only; `before_first_run` is called
        between them and the graph's first run, which computes with their values. `progress`
        hears ("compile", pieces done, pieces) as each piece is compiled or found cached."""
        device = kv_caches[0].device
        ids, positions, meta = dummy_batch(self.model.config.vocab_size, device)
        for t in (ids, positions, meta.slot_mapping, meta.seq_lens, meta.query_start_loc):
            torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(meta.block_tables, 0)
        torch._dynamo.mark_dynamic(meta.block_tables, 1)
        import torch._inductor.config as inductor_config

        marked = {**inductor_config.unsafe_marked_cacheable_functions, **cacheable_references()}
        # Dynamo collects generations 0 and 1 after each compile. The engine pauses the
        # collector for start-up and collects once at its end, so here generation 0 holds all
        # that start-up allocated and Dynamo's collection traverses it (0.24 s of a 32-layer
        # model's start-up on the 2-core CPU) for garbage the engine's own collection frees a
        # moment later. Older torch releases have no such flag.
        dynamo_config = torch._dynamo.config
        no_gc = (
            {"run_gc_after_compile": False}
            if hasattr(dynamo_config, "run_gc_after_compile")
            else {}
        )
        before = _cache_counts()
        start = time.perf_counter()
        self.backend.capture_started = start
        self.backend.before_first_run = before_first_run
        self.backend.progress = progress
        with (
            torch.inference_mode(),
            inductor_config.patch(unsafe_marked_cacheable_functions=marked),
            dynamo_config.patch(no_gc),
        ):
            self._fn(ids, positions, kv_caches, meta)
            if not self.pass_manager.match_counts.get("paged_attention_cpu"):
                # Attention other than paged_attention (MLA's latent ops): no decode form to
                # inline, so the decode graph would only repeat the pieces.
                self._decode_fn, self.decode_backend = None, None
            if self._decode_fn is not None:
                ids, positions, meta = dummy_decode_batch(self.model.config.vocab_size, device)
                for t in (ids, positions, meta.slot_mapping, meta.seq_lens, meta.query_start_loc):
                    torch._dynamo.mark_dynamic(t, 0)
                torch._dynamo.mark_dynamic(meta.block_tables, 0)
                torch._dynamo.mark_dynamic(meta.block_tables, 1)
                # The pool's block count too: the graph holds the cache write, and an artifact
                # built with one pool size serves another (its pieces never see the cache).
                # One symbol for every layer's count (Dynamo's duck sizing, which marked
                # dims do not get): the layers' attention reads are one shared subgraph
                # (kernels_generated/paged_attention_cpu.py), whose inputs must agree.
                for cache in kv_caches:
                    for dim in range(cache.dim()):
                        if dim != 1:
                            torch._dynamo.mark_static(cache, dim)
                with dynamo_config.patch(assume_static_by_default=False):
                    self._decode_fn(ids, positions, kv_caches, meta)
            if self._logits is not None:
                self._logits.warm(
                    self.model.config.hidden_size, self.model.model.embed_tokens.dtype
                )
        self.backend.before_first_run = None
        self.capture_seconds = time.perf_counter() - start
        after = _cache_counts()
        self.cache_stats = {name: after[name] - before[name] for name in after}
        log.info(
            "captured and compiled in %.1f s: %d pieces, %d compiled",
            self.capture_seconds,
            len(self.backend.stats.pieces),
            self.backend.stats.unique_pieces,
        )

    def capture_breakdown(self) -> dict[str, float]:
        """capture_seconds split into Dynamo's trace, the passes, loading or compiling the
        distinct pieces (Inductor), the rest of the backend (split, walking the pieces on
        fake tensors), the caller's `before_first_run` and what follows it (Dynamo's guards
        and code, the first real call)."""
        stats = self.backend.stats
        pieces = sum(p.seconds for p in stats.pieces)
        waited = stats.before_first_run_seconds
        return {
            "dynamo_trace_s": stats.trace_seconds,
            "passes_s": stats.pass_seconds,
            "pieces_s": pieces,
            "backend_other_s": stats.seconds - stats.pass_seconds - pieces,
            "before_first_run_s": waited,
            "after_backend_s": self.capture_seconds - stats.trace_seconds - stats.seconds - waited,
        }

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's compute_logits, the compiled quantized lm_head's GEMV, or on CUDA a
        plain bf16/fp16 lm_head by the skinny GEMM table's choice for its rows (cuBLAS where
        nothing is tuned)."""
        if self._logits is not None:
            return self._logits(hidden)
        if self._head_linear is not None and hidden.is_cuda:
            return self._head_linear(self.config.kernel, hidden, self._head.weight)
        return self.model.compute_logits(hidden)

    @property
    def recompilations(self) -> int:
        decode = self.decode_backend.stats.compilations if self.decode_backend else 1
        return max(0, self.backend.stats.compilations - 1) + max(0, decode - 1)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # Every scheduled sequence has >= 1 new token, so as many tokens as sequences is a
        # decode step: a shape test, no host read.
        if self._decode_fn is not None:
            if input_ids.shape[0] == meta.seq_lens.shape[0]:
                return self._decode_fn(input_ids, positions, kv_caches, meta)
            rows = as_decode_rows(meta, input_ids.shape[0])
            if rows is not None:
                return self._decode_fn(input_ids, positions, kv_caches, rows)
        return self._fn(input_ids, positions, kv_caches, meta)
