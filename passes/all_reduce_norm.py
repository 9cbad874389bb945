"""all_reduce -> add_rms_norm (tensor parallelism) -> one `ce.all_reduce_add_rms_norm` op.

Matches: under tensor parallelism every row-parallel block (o_proj, down_proj, a MoE block)
ends with a sum over the ranks, `wait_tensor(all_reduce(x, "sum", group))` in the captured
graph (models/parallel.py writes them as functional collectives, so Dynamo keeps them as
nodes), whose value goes straight into the next layer's `ce.add_rms_norm` as its x and nowhere
else: in a Llama-family layer the post-attention norm and the next layer's input norm (the
final norm after the last layer), 2 x layers matches. A bias between them (Llama with
attention_bias) or the first layer's norm, which has no residual yet, is left alone. Emits:
`ce.all_reduce_add_rms_norm(x, residual, weight, eps, group)` with add_rms_norm's two outputs.

Applies on cpu, where lower_to_reference then lowers it to its reference (the same
all-reduce, then add + rms_norm for Inductor to fuse): numerically the graph without the
pass. The node is the seam for a fused lowering, which is where the gain is (vLLM's
all-reduce + RMSNorm fusion: up to 15% on several GPUs): a one-shot all-reduce into the norm
over symmetric memory. That kernel is not done; until it is, h100 is not a target, because
claiming the norm there would take it from add_rms_norm_into_gemm and rms_norm_triton.
"""

from __future__ import annotations

import torch
from torch import fx

from compile_engine.passes.base import GraphPass, PassContext, op_nodes
from compile_engine.passes.registry import register


def _reduced_input(node: fx.Node) -> fx.Node | None:
    """x of `wait_tensor(all_reduce(x, "sum", group))` feeding `node` alone, else None."""
    c10d = torch.ops._c10d_functional
    wait = node.args[0]
    if not isinstance(wait, fx.Node) or wait.target is not c10d.wait_tensor.default:
        return None
    reduce = wait.args[0]
    if (
        len(wait.users) != 1
        or not isinstance(reduce, fx.Node)
        or reduce.target is not c10d.all_reduce.default
        or reduce.args[1] != "sum"
        or len(reduce.users) != 1
    ):
        return None
    return reduce


@register
class AllReduceNorm(GraphPass):
    name = "all_reduce_norm"
    description = "all_reduce -> add_rms_norm -> one all_reduce_add_rms_norm op (TP; reference)"
    targets = ("cpu",)

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        fused = torch.ops.ce.all_reduce_add_rms_norm.default
        count = 0
        for node in op_nodes(graph, "add_rms_norm"):
            reduce = _reduced_input(node)
            if reduce is None or node.kwargs:
                continue
            wait = node.args[0]
            x, _, group = reduce.args
            node.target = fused
            node.args = (x, *node.args[1:], group)  # (x, residual, weight, eps, group)
            graph.erase_node(wait)
            graph.erase_node(reduce)
            count += 1
        return count
