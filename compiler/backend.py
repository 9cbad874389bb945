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
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx
from torch._higher_order_ops.invoke_subgraph import invoke_subgraph_infer
from torch.fx.passes.split_module import split_module

from compile_engine.kernels_generated.paged_attention_cpu import paged_attention_decode_cpu
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
    outlined: int = 0  # runs of nodes called as a shared subgraph (`outline_layers`)

    @property
    def unique_pieces(self) -> int:
        return sum(1 for p in self.pieces if p.compiled_here)

    def as_dict(self) -> dict:
        return {
            "compilations": self.compilations,
            "num_pieces": len(self.pieces),
            "num_attention_pieces": sum(p.is_attention for p in self.pieces),
            "num_compiled_pieces": self.unique_pieces,
            "outlined": self.outlined,
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


def split_at_attention(
    gm: fx.GraphModule, is_split: Callable[[fx.Node], bool] = is_split_node
) -> tuple[fx.GraphModule, list[str]]:
    """Partition the graph so that each attention op (each node `is_split` picks) is alone in
    its piece."""
    partition = 0
    assignment: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_split(node):
            partition += 1
            assignment[node] = partition
            partition += 1
        else:
            assignment[node] = partition
    split = split_module(gm, None, lambda node: assignment[node], keep_original_order=True)
    attention = {f"submod_{assignment[n]}" for n in assignment if is_split(n)}
    return split, sorted(attention)


def is_decode_attention(node: fx.Node) -> bool:
    """The CPU decode graph's attention (passes/paged_attention_cpu.py, `decode_only`)."""
    return node.op == "call_function" and node.target is paged_attention_decode_cpu


def outline_layers(
    gm: fx.GraphModule, fake_args: list, is_boundary: Callable[[fx.Node], bool]
) -> tuple[fx.GraphModule, int]:
    """`gm` with every run of nodes between two boundary nodes that recurs (a layer's output
    projection, norms, MLP and next QKV between two attentions) called as one shared subgraph
    (`invoke_subgraph_infer`), which Inductor compiles once and every layer calls: a graph
    that stays whole (the CPU decode graph) need not compile 30 copies of a layer. Returns the
    graph (a split one: each run its submodule) and how many runs share a subgraph."""
    split, boundaries = split_at_attention(gm, is_boundary)
    walk = _PieceKeys(split)
    keys = walk.keys(fake_args)
    counts: dict[str, int] = {}
    for target, key in keys.items():
        if target not in boundaries:
            counts[key] = counts.get(key, 0) + 1
    shared: dict[str, str] = {}  # key -> the region's attribute name
    outlined = 0
    graph = split.graph
    for node in list(graph.nodes):
        if node.op != "call_module" or node.target in boundaries:
            continue
        key = keys[node.target]
        if counts[key] < 2:
            continue
        if key not in shared:
            shared[key] = f"region_{len(shared)}"
            region = _as_region(split.get_submodule(node.target), walk.outputs[node.target])
            split.add_submodule(shared[key], region)
        region = split.get_submodule(shared[key])
        with graph.inserting_before(node):
            call = graph.call_function(call_region, (graph.get_attr(shared[key]), *node.args))
        if region.returns_one:
            with graph.inserting_after(call):
                node.replace_all_uses_with(graph.call_function(operator.getitem, (call, 0)))
        else:
            node.replace_all_uses_with(call)
        graph.erase_node(node)
        delattr(split, node.target)  # the region stays, by its own name
        outlined += 1
    split.recompile()
    return split, outlined


def call_region(region: fx.GraphModule, *args):
    """`invoke_subgraph_infer(region, *args)`: traced (AOTAutograd), one subgraph however many
    calls; in eager, a plain call. A function of ours, since FX's generated code names its
    targets by module path, and torch._higher_order_ops.invoke_subgraph is a HOP's name too."""
    return invoke_subgraph_infer(region, *args)


def _as_region(gm: fx.GraphModule, fake_out) -> fx.GraphModule:
    """`gm` as a subgraph: returning a tuple (`returns_one` set where it returned one value),
    every output contiguous."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    value = output.args[0]
    gm.returns_one = not isinstance(value, tuple | list)
    values = [value] if gm.returns_one else list(value)
    fakes = [fake_out] if gm.returns_one else list(fake_out)
    with gm.graph.inserting_before(output):
        values = [
            gm.graph.call_method("contiguous", (v,))
            if isinstance(f, torch.Tensor) and not f.is_contiguous()
            else v
            for v, f in zip(values, fakes, strict=True)
        ]
    output.args = (tuple(values),)
    gm.recompile()
    return gm


class _KeyedWalk(torch.fx.Interpreter):
    """Walks a split graph on fake tensors, handing `visit` each piece's `structural_key`, its
    inputs and its fake outputs. A piece of a key and non-tensor inputs (the key has only their
    types) already run reuses its outputs: the same graph on inputs of the same metadata gives
    outputs of the same metadata, and only metadata flows on to the next piece (running each
    of 30 identical layers on fake tensors again was a third of the backend's time, 1.0 of 3.05
    s for 32 layers on the 2-core CPU)."""

    def __init__(self, split: fx.GraphModule):
        super().__init__(split)
        self.outputs_seen: dict[tuple, object] = {}

    def call_module(self, target, args, kwargs):
        key = structural_key(self.fetch_attr(target), list(args))
        seen = (key, tuple(repr(a) for a in args if not isinstance(a, torch.Tensor)))
        if kwargs or seen not in self.outputs_seen:
            self.outputs_seen[seen] = super().call_module(target, args, kwargs)
        out = self.outputs_seen[seen]
        self.visit(target, key, args, out)
        return out

    def visit(self, target: str, key: str, args: tuple, out) -> None:
        raise NotImplementedError


class _PieceKeys(_KeyedWalk):
    """Each piece's `structural_key` and fake outputs, by its target."""

    def keys(self, fake_args: list) -> dict[str, str]:
        self.found: dict[str, str] = {}
        self.outputs: dict[str, object] = {}
        self.run(*fake_args)
        return self.found

    def visit(self, target, key, args, out) -> None:
        self.found[target] = key
        self.outputs[target] = out


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

    def __init__(
        self,
        pass_manager: PassManager,
        compile_piece: Callable | None = None,
        outline_between: Callable[[fx.Node], bool] | None = None,
    ) -> None:
        self.pass_manager = pass_manager
        self.compile_piece = compile_piece or inductor_compile
        # A graph that does not split (the CPU decode graph): the nodes between which its
        # recurring runs are outlined into shared subgraphs (`outline_layers`).
        self.outline_between = outline_between
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
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        fake_args = [
            fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in example_inputs
        ]
        if self.outline_between is not None:
            with fake_mode:
                gm, self.stats.outlined = outline_layers(gm, fake_args, self.outline_between)
        split, attention = split_at_attention(gm)
        self.graph = split
        # Under the fake mode, so that a piece's factory calls (the CPU decode attention's
        # arange) make fake tensors too.
        with fake_mode:
            _PieceCompiler(self, split, set(attention)).run(*fake_args)
        self.stats.seconds = time.perf_counter() - start
        if self.before_first_run is not None:
            self.before_first_run()
            self.stats.before_first_run_seconds = time.perf_counter() - start - self.stats.seconds
        return split


class _PieceCompiler(_KeyedWalk):
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

    def visit(self, target, key, args, out) -> None:
        submod = self.fetch_attr(target)
        is_attention = target in self.attention
        record = PieceRecord(target, key, is_attention, len(submod.graph.nodes))
        self.backend.stats.pieces.append(record)
        if is_attention:
            return
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
