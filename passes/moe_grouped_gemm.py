"""Unwrapped MoE: the routed-expert chain -> one fused Triton grouped-GEMM op.

Matches, per sparse MoE layer (models/moe.py, StackedExperts.forward):

    sorted_ids, block_expert = ce.moe_align(topk_ids, E, BLOCK)
    h = ce.moe_grouped_gemm(x, w13, sorted_ids, block_expert, K)
    a = ce.silu_and_mul(h)
    y = ce.moe_grouped_gemm(a, w2, sorted_ids, block_expert, 1)
    out = ce.moe_combine(y, topk_weights)

Emits `ce_kernels.moe_fused_experts(x, w13, w2, topk_weights, topk_ids)`
(kernels_generated/moe_grouped_gemm.py): the alignment redone with the BLOCK_M its tuned tiles
want for this layer's shape and token count (the graph's BLOCK only serves the reference), the
first GEMM with silu_and_mul in its epilogue, the second with the routing weights in its
epilogue, and the sum over K. Sync-free, its grid sized from shapes: CUDA-graph safe, which the
reference (a host loop over the experts present) is not. The router (`ce.moe_route`) and the
shared expert stay outside, for Inductor to fuse with their neighbours.

Applies on h100 (Triton on sm_90); on CPU the reference's per-expert loop is the faster path.
Registered before the silu_and_mul kernel passes, which would otherwise take the `silu_and_mul`
node out of the chain.
"""

from __future__ import annotations

import hashlib
import operator
from pathlib import Path

import torch
from torch import fx

from compile_engine.passes.base import GraphPass, PassContext, op_nodes
from compile_engine.passes.registry import register

REPO_ROOT = Path(__file__).resolve().parents[1]
_KERNEL_FILES = (
    "kernels_generated/moe_grouped_gemm.py",
    "kernels_generated/configs/moe_grouped_gemm.json",
)


def _is_op(node: object, name: str) -> bool:
    overload = getattr(torch.ops.ce, name).default
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is overload


def _align_of(sorted_ids: fx.Node, block_expert: fx.Node) -> fx.Node | None:
    """The moe_align node both alignment outputs come from (outputs 0 and 1), else None."""
    outputs = (sorted_ids, block_expert)
    if not all(n.op == "call_function" and n.target is operator.getitem for n in outputs):
        return None
    (align, first), (other, second) = sorted_ids.args, block_expert.args
    if align is not other or (first, second) != (0, 1) or not _is_op(align, "moe_align"):
        return None
    return align


def match_chain(combine: fx.Node) -> tuple[fx.Node, ...] | None:
    """(x, w13, w2, topk_weights, topk_ids) of the chain ending in `combine`, else None."""
    down, topk_weights = combine.args
    if not _is_op(down, "moe_grouped_gemm") or down.args[4] != 1:
        return None
    act, w2, sorted_ids, block_expert, _ = down.args
    if not _is_op(act, "silu_and_mul") or not _is_op(act.args[0], "moe_grouped_gemm"):
        return None
    x, w13, sorted_up, block_up, _ = act.args[0].args
    if (sorted_up, block_up) != (sorted_ids, block_expert):
        return None
    align = _align_of(sorted_ids, block_expert)
    if align is None:
        return None
    return x, w13, w2, topk_weights, align.args[0]


@register
class MoEGroupedGemm(GraphPass):
    name = "moe_grouped_gemm"
    description = "MoE align + grouped GEMMs + silu + combine -> one fused Triton grouped GEMM"
    targets = ("h100",)

    def uuid(self) -> str:
        # The rewritten graph calls the kernel with its tuned tiles: a change in either must
        # change the artifact's cache key, not only a change in this class.
        h = hashlib.sha256(super().uuid().encode())
        for path in _KERNEL_FILES:
            h.update((REPO_ROOT / path).read_bytes())
        return h.hexdigest()[:16]

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        import compile_engine.kernels_generated.moe_grouped_gemm  # noqa: F401  (registers ce_kernels ops)
        import compile_engine.models.moe  # noqa: F401  (registers the ce MoE ops)

        fused = torch.ops.ce_kernels.moe_fused_experts.default
        count = 0
        for combine in op_nodes(graph, "moe_combine"):
            args = match_chain(combine)
            if args is None:
                continue
            with graph.inserting_before(combine):
                node = graph.call_function(fused, (*args, ctx.kernel.key))
            node.meta.update(combine.meta)
            combine.replace_all_uses_with(node)
            graph.erase_node(combine)
            count += 1
        # The align, GEMM and silu nodes are now dead; the pass manager's DCE drops them
        # (it treats our ops as pure: none of them mutates its inputs).
        return count
