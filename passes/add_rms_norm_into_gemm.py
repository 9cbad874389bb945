"""add_rms_norm feeding a bias-free linear -> one op that fuses the norm into the skinny GEMM.

Matches: a `ce.add_rms_norm` node whose normalised output has exactly one user, a bias-free
`F.linear` (in a Llama-family layer: the input norm before qkv_proj, from the second layer on,
and the post-attention norm before gate_up_proj; 2 x layers - 1 matches). Emits:
`ce_kernels.add_rms_norm_linear(x, residual, norm_weight, eps, w)` -> (y, x + residual), whose
two outputs take over the linear's users and the residual sum's. Per call it runs, at most
NORM_MAX_ROWS (16) rows where the weight's tuned kernel is the Triton skinny GEMM
(configs/skinny_gemm.json), one kernel: each program computes the norm's mean of squares over
its rows and normalises every x tile as it loads it (kernels_generated/skinny_gemm.py,
`add_rms_norm_gemm`); otherwise the Triton norm kernel then `skinny_linear`'s choice.
Applies on h100 in bf16/fp16.

Why: at batch 1 a layer's two norms are two launches of about 2.5 us each between GEMVs
(Inductor's fused add + rms_norm; 165 us a step of 4.35 ms at 57cd701, H200, `bench breakdown
--kernels`), plus the gaps around them. Off by default: not yet measured in the engine.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

from passes.base import GraphPass, PassContext, op_nodes
from passes.registry import register


def _getitems(node: fx.Node) -> dict[int, list[fx.Node]]:
    """`node`'s users by tuple index; an empty dict if any user is not a getitem."""
    by_index: dict[int, list[fx.Node]] = {}
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem:
            return {}
        by_index.setdefault(user.args[1], []).append(user)
    return by_index


def _sole_bias_free_linear(node: fx.Node) -> fx.Node | None:
    """The one user of `node` if it is F.linear(node, w) without a bias, else None."""
    if len(node.users) != 1:
        return None
    (user,) = node.users
    if user.op != "call_function" or user.target is not F.linear or user.args[0] is not node:
        return None
    bias = user.args[2] if len(user.args) > 2 else user.kwargs.get("bias")
    return user if bias is None and len(user.args) >= 2 else None


@register
class AddRmsNormIntoGemm(GraphPass):
    name = "add_rms_norm_into_gemm"
    description = "add_rms_norm -> linear: the norm fused into the skinny GEMM at <= 16 rows (off)"
    targets = ("h100",)
    dtypes = (torch.bfloat16, torch.float16)
    default_on = False
    kernel_files = (
        "kernels_generated/skinny_gemm.py",
        "kernels_generated/configs/skinny_gemm.json",
        "kernels_generated/add_rms_norm.py",
    )

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        import kernels_generated.skinny_gemm  # noqa: F401  (registers ce_kernels ops)

        kernel = torch.ops.ce_kernels.add_rms_norm_linear.default
        order = {node: i for i, node in enumerate(graph.nodes)}
        matches = 0
        for norm in op_nodes(graph, "add_rms_norm"):
            outputs = _getitems(norm)
            if len(outputs.get(0, ())) != 1:
                continue
            linear = _sole_bias_free_linear(outputs[0][0])
            weight = linear.args[1] if linear is not None else None
            # The fused node replaces the norm where it stands, so the weight must exist there
            # (a parameter placeholder at the top of the graph does).
            if weight is None or (isinstance(weight, fx.Node) and order[weight] > order[norm]):
                continue
            x, residual, norm_weight, eps = norm.args
            with graph.inserting_before(norm):
                fused = graph.call_function(kernel, (x, residual, norm_weight, eps, weight))
                out = graph.call_function(operator.getitem, (fused, 0))
                summed = graph.call_function(operator.getitem, (fused, 1))
            out.meta.update(linear.meta)
            if 1 in outputs:
                summed.meta.update(outputs[1][0].meta)
            if "val" in out.meta and "val" in summed.meta:
                fused.meta["val"] = (out.meta["val"], summed.meta["val"])
            linear.replace_all_uses_with(out)
            for getitem in outputs.get(1, ()):
                getitem.replace_all_uses_with(summed)
            for dead in (linear, outputs[0][0], *outputs.get(1, ()), norm):
                graph.erase_node(dead)
            matches += 1
        return matches
