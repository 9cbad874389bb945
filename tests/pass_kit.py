"""The pass authoring kit: trace a tiny real model, count matches, compare numerics with the
pass on and off. A pass's test is then a few lines:

    from pass_kit import assert_numerics_unchanged, capture_graph, count_matches

    gm = capture_graph("llama")
    assert count_matches("my_pass", gm, PassContext("h100", torch.bfloat16)) == 2
    assert_numerics_unchanged("my_pass", model_dir)

It lives in tests/, not in passes/: it drives the compiler (a layer above the passes) and the
tests' tiny models and paged-cache harness, which test modules import by name (pytest's
pythonpath holds tests/). Those, and the compiler, are imported inside the functions that need
them, because run_interpreted's child pytests import this module too and should not pay for
transformers and Inductor's set-up when they only run kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import fx

from compile_engine.passes.base import GraphPass, PassContext
from compile_engine.passes.manager import PassManager
from compile_engine.passes.registry import REGISTRY, load_all

REPO_ROOT = Path(__file__).resolve().parents[1]


class KitError(RuntimeError):
    """The kit cannot do what was asked (an unknown pass, a pass that matched nothing)."""


def get_pass(pass_: str | GraphPass) -> GraphPass:
    load_all()
    if isinstance(pass_, GraphPass):
        return pass_
    if pass_ not in REGISTRY:
        raise KitError(f"unknown pass {pass_!r}; registered: {', '.join(REGISTRY)}")
    return REGISTRY[pass_]


# --------------------------------------------------------------------------- capture


def make_model_dir(model_name: str, directory: Path | None = None, seed: int = 0) -> Path:
    """Write the tiny random HF model `model_name` (tests/tiny_models.TINY_ARCHS) to
    `directory` (default: a new temporary directory) and return the directory."""
    from tiny_models import make_tiny_model

    directory = Path(directory or tempfile.mkdtemp(prefix=f"ce-{model_name}-"))
    make_tiny_model(model_name, directory, seed=seed)
    return directory


def _record(graphs: list[fx.GraphModule]) -> Callable:
    def backend(gm: fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(gm)
        return gm.forward

    return backend


def capture_graph(
    model_name: str = "llama",
    *,
    model_dir: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    parallel=None,
) -> fx.GraphModule:
    """The whole-model FX graph exactly as our backend receives it from Dynamo (our ops as
    single `torch.ops.ce.*` nodes, before any pass), for a tiny `model_name` or the model in
    `model_dir`. Traced like CompiledForward.capture: same dummy batch, token dims dynamic,
    floats specialised; the recording backend returns the graph uncompiled (no Inductor).
    `parallel` (models.parallel.TensorParallel): trace that rank's shard."""
    from compile_engine.compiler.compiled_model import (
        _drop_all_guards,
        _own_code_object,
        dummy_batch,
    )
    from compile_engine.models.loader import load_model

    model_dir = model_dir or make_model_dir(model_name)
    model = load_model(model_dir, dtype=dtype, parallel=parallel).model
    cfg = model.config
    kv_caches = [
        torch.zeros(model.kv_cache_shape(2, 16), dtype=dtype) for _ in range(cfg.num_layers)
    ]
    ids, positions, meta = dummy_batch(cfg.vocab_size, torch.device("cpu"))
    for t in (ids, positions, meta.slot_mapping, meta.seq_lens, meta.query_start_loc):
        torch._dynamo.mark_dynamic(t, 0)
    torch._dynamo.mark_dynamic(meta.block_tables, 0)
    torch._dynamo.mark_dynamic(meta.block_tables, 1)
    graphs: list[fx.GraphModule] = []
    fn = torch.compile(
        _own_code_object(model.forward),  # a fresh code object: never reuse another trace
        backend=_record(graphs),
        fullgraph=True,
        dynamic=False,
        options={"guard_filter_fn": _drop_all_guards},
    )
    with torch._dynamo.config.patch(specialize_float=True), torch.inference_mode():
        fn(ids, positions, kv_caches, meta)
    if len(graphs) != 1:
        raise KitError(f"expected one graph from Dynamo, got {len(graphs)}")
    return graphs[0]


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy whose graph a pass may rewrite; parameters and buffers are shared, not copied."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


def count_matches(pass_: str | GraphPass, graph: fx.GraphModule, ctx: PassContext) -> int:
    """How many matches `pass_` rewrites in (a copy of) `graph` under `ctx`, as the pass
    manager would count them: 0 where the pass does not apply. The rewritten copy must still
    be a valid graph."""
    pass_ = get_pass(pass_)
    gm = copy_graph(graph)
    manager = PassManager([pass_], ctx)
    manager(gm.graph)
    gm.recompile()
    return manager.match_counts[pass_.name]


def apply_pass(pass_: str | GraphPass, graph: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """A rewritten copy of `graph`, for tests that look at what the pass emitted."""
    gm = copy_graph(graph)
    PassManager([get_pass(pass_)], ctx)(gm.graph)
    gm.recompile()
    return gm


def targets_of(graph: fx.GraphModule) -> list:
    """The call_function targets of `graph`, in order (what a pass retargeted shows here)."""
    return [n.target for n in graph.graph.nodes if n.op == "call_function"]


# --------------------------------------------------------------------------- numerics


class _CompiledModel:
    """What PagedHarness needs of a model, with forward replaced by a compiled one."""

    def __init__(self, model: torch.nn.Module, forward: Callable) -> None:
        self.model, self.forward, self.config = model, forward, model.config

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return self.model.parameters()

    def __call__(self, *args):
        return self.forward(*args)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return self.model.kv_cache_shape(num_blocks, block_size)


def _eager_piece(gm: fx.GraphModule, args: list) -> Callable:
    return gm


def compiled_logits(
    model_dir: str | Path,
    passes: list[GraphPass],
    ctx: PassContext,
    *,
    inductor: bool = False,
    sequences: list[list[int]] | None = None,
    prefill_chunk: int = 5,
    decode_tail: int = 3,
    parallel=None,
) -> tuple[list[torch.Tensor], dict[str, int]]:
    """Per-sequence logits of the model in `model_dir` compiled with exactly `passes`, driven
    through the paged cache by a packed, chunked schedule (tests/paged_harness.run_schedule).

    The capture, pass manager and piecewise split are CompiledForward's; only the pass list
    is set here, because `--passes` always adds lower_to_reference and so could never switch
    that pass off. With `inductor=False` each piece runs as its rewritten FX graph (seconds);
    with `inductor=True` Inductor compiles the pieces as in a build (tens of seconds on CPU).
    Returns the logits and the pass manager's match counts. `parallel`: run that rank's
    shard (models.parallel.TensorParallel).
    """
    from compile_engine.compiler.compiled_model import CompiledForward
    from compile_engine.compiler.config import CompileConfig
    from compile_engine.models.loader import load_model

    from paged_harness import PagedHarness, run_schedule

    loaded = load_model(model_dir, dtype=ctx.dtype, parallel=parallel)
    compiled = CompiledForward(loaded.model, CompileConfig(target=ctx.target), ctx.dtype)
    manager = PassManager(list(passes), ctx)
    compiled.pass_manager = compiled.backend.pass_manager = manager
    if not inductor:
        compiled.backend.compile_piece = _eager_piece
    harness = PagedHarness(_CompiledModel(loaded.model, compiled), block_size=4, num_blocks=64)
    cfg = loaded.config
    compiled.capture(harness.kv_caches)
    if sequences is None:
        gen = torch.Generator().manual_seed(0)
        sequences = [
            torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in (13, 6, 21)
        ]
    logits = run_schedule(harness, sequences, prefill_chunk, decode_tail)
    if compiled.recompilations:
        raise KitError(f"the schedule recompiled the graph {compiled.recompilations} times")
    return logits, dict(manager.match_counts)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: the measure of tests/models' HF comparisons."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def assert_numerics_unchanged(
    pass_name: str,
    model_dir: str | Path,
    *,
    target: str = "cpu",
    dtype: torch.dtype = torch.float32,
    rtol: float = 1e-4,
    inductor: bool = False,
    sequences: list[list[int]] | None = None,
    parallel=None,
) -> dict[str, float]:
    """Logits with the pass on equal those with it off (no passes at all, so the ops run
    their references), within `rtol` relative to the largest logit, over a packed chunked
    schedule. Fails too if the pass matched nothing: a comparison of two identical graphs
    proves nothing. Returns {"matches": n, "max_relative_error": e} for the test to report."""
    pass_ = get_pass(pass_name)
    ctx = PassContext(target, dtype)
    if not pass_.applies(ctx):
        raise KitError(f"pass {pass_.name} does not apply to target {target} in {dtype}")
    on, counts = compiled_logits(
        model_dir, [pass_], ctx, inductor=inductor, sequences=sequences, parallel=parallel
    )
    matches = counts[pass_.name]
    if matches == 0:
        raise KitError(f"pass {pass_.name} matched nothing in {model_dir}: nothing to compare")
    off, _ = compiled_logits(
        model_dir, [], ctx, inductor=inductor, sequences=sequences, parallel=parallel
    )
    worst = max(relative_error(a, b) for a, b in zip(on, off, strict=True))
    if not worst <= rtol:  # a NaN error (non-finite logits) fails too
        raise AssertionError(
            f"pass {pass_.name}: logits with the pass differ from without it by {worst:.2e} "
            f"(relative), above rtol {rtol:.0e}"
        )
    return {"max_relative_error": worst, "matches": matches}


# --------------------------------------------------------------------------- interpreters


def run_interpreted(
    test_file: str | Path, env_var: str, *pytest_args: str, timeout: int = 600
) -> subprocess.CompletedProcess:
    """Run `test_file`'s tests in a child pytest with `env_var`=1 (HELION_INTERPRET or
    TRITON_INTERPRET). Both are read when a kernel is defined, and both would leak into every
    later test of this process (on the GPU machine, turning compiled kernels into Python), so
    the interpreted CPU cases run in a child whose environment has the variable from its start.
    The two interpreters refuse each other, so the child drops the other one."""
    env = {**os.environ, env_var: "1", "PYTHONUNBUFFERED": "1"}
    for other in ("HELION_INTERPRET", "TRITON_INTERPRET"):
        if other != env_var:
            env.pop(other, None)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)]
    return subprocess.run(
        [*command, *pytest_args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
