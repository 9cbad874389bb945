"""What a fusion pass is: one class in one file.

A pass rewrites the captured FX graph of a whole model (torch-level IR, our `ce` ops as single
nodes) before the graph is split at attention and handed to Inductor. It says what it matches,
where it applies (targets, dtypes) and how it changes the cache key (`uuid`), and it returns
how many matches it rewrote so that `build` can record it per model.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import fx

from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.tuning import KernelConfig

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class PassContext:
    """Where the graph will run (passes use it to decide whether they apply) and the kernel
    config the kernels they lower to launch with: a pass gives a kernel op `kernel.key` as its
    last argument (`lower`)."""

    target: str  # "cpu" | "h100"
    dtype: torch.dtype
    kernel: KernelConfig = field(default_factory=tuning.default)
    # The graph runs only steps in which every sequence has one new token (the CPU's decode
    # graph, compiler/compiled_model.py): an attention pass may lower to a decode-only form.
    decode_only: bool = False


class GraphPass:
    """Subclass, set the class attributes, implement `apply`, and decorate with @register."""

    name: str = ""
    description: str = ""
    targets: tuple[str, ...] = ("cpu", "h100")
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    default_on: bool = True
    # Files (relative to the repository root) that the rewritten graph calls into, such as the
    # kernel and its tuned configs: their bytes feed uuid(), so retuning rebuilds artifacts.
    kernel_files: tuple[str, ...] = ()

    def applies(self, ctx: PassContext) -> bool:
        return ctx.target in self.targets and ctx.dtype in self.dtypes

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        """Rewrite `graph` in place; return the number of matches rewritten."""
        raise NotImplementedError

    def uuid(self) -> str:
        """Changes whenever the pass's code or its kernel_files change, so compiled artifacts
        are rebuilt."""
        h = hashlib.sha256(inspect.getsource(type(self)).encode())
        for path in self.kernel_files:
            h.update((REPO_ROOT / path).read_bytes())
        return h.hexdigest()[:16]


def op_nodes(graph: fx.Graph, name: str) -> list[fx.Node]:
    """The call nodes of our op `name` (torch.ops.ce.<name>)."""
    overload = getattr(torch.ops.ce, name).default
    return [n for n in graph.nodes if n.op == "call_function" and n.target is overload]


def lower(node: fx.Node, kernel_op, ctx: PassContext) -> None:
    """Point `node` at our kernel op, its arguments followed by the kernel config's key: how
    the tuning reaches the launch (kernels_generated/tuning.py)."""
    node.target = kernel_op
    node.args = (*node.args, *node.kwargs.values(), ctx.kernel.key)
    node.kwargs = {}
