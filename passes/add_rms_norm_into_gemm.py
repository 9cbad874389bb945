"""add_rms_norm feeding a bias-free linear (and silu_and_mul after it) -> one op that fuses
the norm, and the activation, into the skinny GEMM.

Matches: a `ce.add_rms_norm` node whose normalised output has exactly one user, a bias-free
`F.linear` (in a Llama-family layer: the input norm before qkv_proj, from the second layer on,
and the post-attention norm before gate_up_proj; 2 x layers - 1 matches); when that linear's
only user is `ce.silu_and_mul` (gate_up_proj), it is taken too. Emits:
`ce_kernels.add_rms_norm_linear(x, residual, norm_weight, eps, w, gated)` -> (y, x + residual),
whose two outputs take over the last taken node's users and the residual sum's. Per call it
runs, at most NORM_MAX_ROWS (16) rows where the weight's table entry has a `fused` record for
the launch kind (configs/skinny_gemm.json, written by `bench gemm-norm --write-configs` only
where the fused launch beat the unfused chain), one kernel: each program accumulates its
rows' mean of squares beside the dot product and scales by 1 / rms at the end (a split launch
reads the rows first), and gated, it owns the gate and the up rows of its output columns and
applies silu_and_mul before the store (kernels_generated/skinny_gemm.py, `add_rms_norm_gemm`);
otherwise the Triton norm kernel, `skinny_linear`'s choice and the Triton silu_and_mul.
Applies on h100 in bf16/fp16.

Why: a batch-1 layer runs 8 kernels, 3 of them small ones between the GEMVs (two of
Inductor's fused add + rms_norm and silu_and_mul: 165 + 50 us a step of 4.35 ms at 57cd701,
H200, `bench breakdown --kernels`), each with a launch gap; fused, 5. Measured in the engine
(H200, c7d6b25, `latency_ab.sh`, 2 runs each): batch 1 237.3 / 237.7 tok/s against 232.4 /
231.7 without, batch 64 13,084.3 against 13,041.5, batch 256 29,072.2 against 28,865.4.
Serving (512/256 at concurrency 256, 768 prompts, one run each, same machine): 9,254.2 output
tok/s against 8,876.6 without at 70bb76a, where every serving step replays a CUDA graph. While
steps above 512 tokens ran outside graphs (d65d012) it lost there, 7,260.8 against 8,032.4:
outside a graph its unfused path (our norm kernel, `linear`, silu_and_mul) is launched piece by
piece from Python in place of Inductor's one fused norm.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

from compile_engine.passes.base import GraphPass, PassContext, op_nodes
from compile_engine.passes.registry import register


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
    description = "add_rms_norm -> linear [-> silu_and_mul] fused in the skinny GEMM, <= 16 rows"
    targets = ("h100",)
    dtypes = (torch.bfloat16, torch.float16)
    kernel_files = (
        "kernels_generated/skinny_gemm.py",
        "kernels_generated/counters.py",
        "kernels_generated/configs/skinny_gemm.json",
        "kernels_generated/add_rms_norm.py",
    )

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        import compile_engine.kernels_generated.skinny_gemm  # noqa: F401  (registers ce_kernels ops)

        kernel = torch.ops.ce_kernels.add_rms_norm_linear.default
        silu = torch.ops.ce.silu_and_mul.default
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
            # gate_up_proj's product goes on to silu_and_mul alone: that becomes the epilogue.
            users = list(linear.users)
            activation = users[0] if len(users) == 1 and users[0].target is silu else None
            last = activation or linear
            x, residual, norm_weight, eps = norm.args
            args = (x, residual, norm_weight, eps, weight, activation is not None, ctx.kernel.key)
            with graph.inserting_before(norm):
                fused = graph.call_function(kernel, args)
                out = graph.call_function(operator.getitem, (fused, 0))
                summed = graph.call_function(operator.getitem, (fused, 1))
            out.meta.update(last.meta)
            if 1 in outputs:
                summed.meta.update(outputs[1][0].meta)
            if "val" in out.meta and "val" in summed.meta:
                fused.meta["val"] = (out.meta["val"], summed.meta["val"])
            last.replace_all_uses_with(out)
            for getitem in outputs.get(1, ()):
                getitem.replace_all_uses_with(summed)
            for dead in (*([activation] if activation else []), linear, outputs[0][0]):
                graph.erase_node(dead)
            for dead in (*outputs.get(1, ()), norm):
                graph.erase_node(dead)
            matches += 1
        return matches
