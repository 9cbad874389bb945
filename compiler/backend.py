"""Our torch.compile backend: passes, piecewise split at attention, Inductor per piece.

Dynamo hands us the whole model as one FX graph (our `ce` ops as single nodes, parameters as
placeholders). We

1. run the pass manager over it (kernel passes, then reference lowering of the rest);
2. split it at every `paged_attention` node: attention runs between compiled pieces, so the
   pieces are pure functions of their inputs (the KV cache write lives in attention), which
   is what CUDA graphs of mixed batches and Inductor both want;
3. compile each piece with Inductor for the dynamic token count. Layers 1..N-1 produce
   structurally identical pieces (only their parameter placeholders differ), so each distinct
   piece is compiled once and reused; a model of 32 layers compiles three pieces, not 65.
   Inductor runs one post-grad pass of ours (compiler/inductor_passes.py) that keeps the
   residual adds out of addmm, whose 2-D input aten would copy before every GEMM.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from compile_engine.models import vocabulary  # also registers every torch.ops.ce op
from compile_engine.passes.manager import PassManager

log = logging.getLogger(__name__)

# Attention ops are where the graph splits: the reference and every kernel lowering of it.
# MLA's naive op and its absorbed latent core (passes/mla_absorb.py) are attention too.
SPLIT_OP_NAMES = (
    "ce::paged_attention",
    "ce_kernels::paged_attention",
    "ce_kernels::paged_attention_rotary",
    "ce_kernels::paged_attention_cpu",
    "ce::mla_attention",
    "ce::mla_latent_attention",
    "ce_kernels::mla_latent_attention",
)


def is_split_node(node: fx.Node) -> bool:
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and target._schema.name in SPLIT_OP_NAMES
    )


# Kernel lowerings that read device values on the host as their op's reference does, by the
# op they lower: the CPU attention's decode path reads seq_lens.
HOST_SYNC_KERNELS = {"ce_kernels::paged_attention_cpu": "paged_attention"}


def host_sync_ops(graph: fx.Graph) -> list[str]:
    """The `ce` ops in `graph` whose reference synchronises with the host (and the kernels of
    HOST_SYNC_KERNELS, by their op's name)."""
    names = {
        node.target._schema.name
        for node in graph.nodes
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
    }
    found = {n.removeprefix("ce::") for n in names if n.startswith("ce::")}
    found |= {HOST_SYNC_KERNELS[n] for n in names if n in HOST_SYNC_KERNELS}
    return sorted(found & vocabulary.HOST_SYNC_OPS)


@dataclass(slots=True)
class PieceRecord:
    name: str
    key: str
    is_attention: bool
    num_nodes: int
    compiled_here: bool = False  # False when reused from an identical piece
    seconds: float = 0.0
    cache: str = ""  # "hit" | "miss" | "" (Inductor's FX graph cache)


@dataclass(slots=True)
class BackendStats:
    compilations: int = 0  # how many graphs Dynamo handed us; > 1 after warm-up = recompile
    pieces: list[PieceRecord] = field(default_factory=list)
    # ce ops left after the passes whose reference reads device values on the host
    # (models.vocabulary.HOST_SYNC_OPS): while any remains, the graph cannot be CUDA-graph captured.
    host_sync_ops: list[str] = field(default_factory=list)
    trace_seconds: float = 0.0  # Dynamo, from the first call until it hands us the graph
    pass_seconds: float = 0.0
    seconds: float = 0.0  # passes + split + Inductor
    before_first_run_seconds: float = 0.0  # in the caller's hook (waiting for the weights)

    @property
    def unique_pieces(self) -> int:
        return sum(1 for p in self.pieces if p.compiled_here)

    def as_dict(self) -> dict:
        return {
            "compilations": self.compilations,
            "num_pieces": len(self.pieces),
            "num_attention_pieces": sum(p.is_attention for p in self.pieces),
            "num_compiled_pieces": self.unique_pieces,
            "host_sync_ops": self.host_sync_ops,
            "trace_seconds": round(self.trace_seconds, 2),
            "pass_seconds": round(self.pass_seconds, 2),
            "backend_seconds": round(self.seconds, 2),
            "pieces": [
                {
                    "key": p.key,
                    "nodes": p.num_nodes,
                    "seconds": round(p.seconds, 2),
                    "cache": p.cache,
                    "reused_by": sum(q.key == p.key for q in self.pieces) - 1,
                }
                for p in self.pieces
                if p.compiled_here
            ],
        }


def split_at_attention(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[str]]:
    """Partition the graph so that each attention op is alone in its piece."""
    partition = 0
    assignment: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_split_node(node):
            partition += 1
            assignment[node] = partition
            partition += 1
        else:
            assignment[node] = partition
    split = split_module(gm, None, lambda node: assignment[node], keep_original_order=True)
    attention = {f"submod_{assignment[n]}" for n in assignment if is_split_node(n)}
    return split, sorted(attention)


def structural_key(gm: fx.GraphModule, args: list) -> str:
    """Same key iff two pieces compute the same function of same-shaped inputs: node names
    and parameter identities are ignored."""
    index: dict[fx.Node, int] = {}
    h = hashlib.sha256()
    placeholders = iter(args)

    def ref(a):
        return f"%{index[a]}" if isinstance(a, fx.Node) else repr(a)

    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        if node.op == "placeholder":
            arg = next(placeholders)
            if isinstance(arg, torch.Tensor):
                h.update(f"P{tuple(arg.shape)}{arg.stride()}{arg.dtype};".encode())
            else:
                h.update(f"P{type(arg).__name__};".encode())
            continue
        target = getattr(node.target, "__qualname__", None) or str(node.target)
        args_s = torch.fx.node.map_aggregate(node.args, ref)
        kwargs_s = torch.fx.node.map_aggregate(node.kwargs, ref)
        h.update(f"{node.op}:{target}:{args_s}:{kwargs_s};".encode())
    return h.hexdigest()[:16]


class PiecewiseBackend:
    """The callable handed to torch.compile(backend=...)."""

    def __init__(self, pass_manager: PassManager, compile_piece: Callable | None = None) -> None:
        self.pass_manager = pass_manager
        self.compile_piece = compile_piece or inductor_compile
        self.stats = BackendStats()
        self.graph: fx.GraphModule | None = None
        self.capture_started: float | None = None  # set by the caller to time Dynamo
        # Called once the pieces are compiled, before Dynamo runs the graph for the first time:
        # the engine waits there for the weights it reads on a thread, so that the graph never
        # computes on parameters not yet read.
        self.before_first_run: Callable[[], None] | None = None
        self.progress: Callable[[str, int, int | None], None] | None = None  # (task, done, total)

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        self.stats.compilations += 1
        if self.stats.compilations > 1:
            log.error(
                "RECOMPILATION #%d of the model graph: Dynamo traced it again (a new input "
                "shape/dtype or a graph break?); serving continues but pays compile time",
                self.stats.compilations,
            )
        start = time.perf_counter()
        if self.capture_started is not None:
            self.stats.trace_seconds = start - self.capture_started
        self.pass_manager(gm.graph)
        gm.recompile()
        self.stats.host_sync_ops = host_sync_ops(gm.graph)
        self.stats.pass_seconds = time.perf_counter() - start
        split, attention = split_at_attention(gm)
        self.graph = split
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        fake_args = [
            fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in example_inputs
        ]
        # Under the fake mode, so that a piece's factory calls (the CPU decode attention's
        # arange) make fake tensors too.
        with fake_mode:
            _PieceCompiler(self, split, set(attention)).run(*fake_args)
        self.stats.seconds = time.perf_counter() - start
        if self.before_first_run is not None:
            self.before_first_run()
            self.stats.before_first_run_seconds = time.perf_counter() - start - self.stats.seconds
        return split


class _PieceCompiler(torch.fx.Interpreter):
    """Walks the split graph on fake tensors; compiles each non-attention piece with the
    fake inputs it receives (symbolic token count), reusing identical pieces."""

    def __init__(self, backend: PiecewiseBackend, split: fx.GraphModule, attention: set[str]):
        super().__init__(split)
        self.backend, self.split, self.attention = backend, split, attention
        self.compiled: dict[str, Callable] = {}
        self.pieces_to_compile = sum(
            1 for n in split.graph.nodes if n.op == "call_module" and n.target not in attention
        )
        self.pieces_done = 0
        # Fake outputs of each piece already run, by its key and its non-tensor inputs' values
        # (the structural key has only their types). The same graph on inputs of the same
        # metadata gives outputs of the same metadata, and only metadata flows on to the next
        # piece: running each of 30 identical layers on fake tensors again was a third of the
        # backend's time (1.0 of 3.05 s for 32 layers on the 2-core CPU).
        self.outputs: dict[tuple, object] = {}

    def call_module(self, target, args, kwargs):
        submod = self.fetch_attr(target)
        is_attention = target in self.attention
        key = structural_key(submod, list(args))
        seen = (key, tuple(repr(a) for a in args if not isinstance(a, torch.Tensor)))
        if kwargs or seen not in self.outputs:
            self.outputs[seen] = super().call_module(target, args, kwargs)
        out = self.outputs[seen]
        record = PieceRecord(target, key, is_attention, len(submod.graph.nodes))
        self.backend.stats.pieces.append(record)
        if is_attention:
            return out
        if key not in self.compiled:
            start = time.perf_counter()
            hits = _cache_counter("fxgraph_cache_hit")
            compiled = self.backend.compile_piece(submod, list(args))
            record.seconds = time.perf_counter() - start
            record.cache = "hit" if _cache_counter("fxgraph_cache_hit") > hits else "miss"
            record.compiled_here = True
            self.compiled[key] = compiled  # returns what the piece returns, tuple or not
            log.info("piece %s (%s): %.2f s, cache %s", target, key, record.seconds, record.cache)
        # The split graph calls its submodules by attribute: swap in the compiled callable.
        self.split.__dict__[target] = self.compiled[key]
        self.pieces_done += 1
        if self.backend.progress is not None:
            self.backend.progress("compile", self.pieces_done, self.pieces_to_compile)
        return out


def _cache_counter(name: str) -> int:
    return torch._dynamo.utils.counters["inductor"][name]


def inductor_compile(gm: fx.GraphModule, args: list) -> Callable:
    # Imported here, not at the top: it imports Inductor (and Triton with it), 3 s of
    # `import runtime` on the H200, which the engine pays only if it compiles.
    from compile_engine.compiler.inductor_passes import UNFUSE_RESIDUAL_ADDMM

    # Our post-grad pass undoes Inductor's mm + residual -> addmm fusion, whose 2-D `self`
    # aten copies into the output before the GEMM (compiler/inductor_passes.py). Patched per
    # compile, not globally, so other torch.compile users in the process keep Inductor's own.
    with torch._inductor.config.patch(post_grad_custom_post_pass=UNFUSE_RESIDUAL_ADDMM):
        return torch._inductor.standalone_compile(gm, args, dynamic_shapes="from_tracing_context")
