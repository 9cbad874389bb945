"""Bias-free linear layers -> the tuned skinny GEMM (kernels_generated/skinny_gemm.py).

Matches: every `F.linear(x, w)` call without a bias in the captured graph (Dynamo records
`torch._C._nn.linear`; in a Llama-family model qkv_proj, o_proj, gate_up_proj and down_proj of
every layer; lm_head runs outside the graph, in compute_logits). A linear with a bias (Qwen2's
qkv) is left to Inductor. Emits: `ce_kernels.skinny_linear(x, w)`, an opaque custom op that
picks, per call, the Triton skinny GEMM config tuned for the weight's exact (N, K) and the row
count's power-of-two bucket (configs/skinny_gemm.json), or cuBLAS (F.linear) where cuBLAS won
the sweep, where the shape was never tuned, or above 256 rows. Inside a CUDA graph the choice is
made once, at capture, so the per-call Python cost only touches steps that run without a
graph (prefills above the largest captured size, which go straight to cuBLAS). Applies on h100
in bf16/fp16. Weights stay as the checkpoint lays them out ([N, K], K contiguous).

Off by default until the end-to-end decode latency with it on is measured (docs/compiler.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

from passes.base import GraphPass, PassContext
from passes.registry import register


def bias_free_linears(graph: fx.Graph) -> list[fx.Node]:
    """The F.linear(x, w) call nodes whose bias is absent or None."""
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not F.linear:
            continue
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if bias is None and len(node.args) >= 2:
            found.append(node)
    return found


@register
class SkinnyGemm(GraphPass):
    name = "skinny_gemm"
    description = "bias-free linear -> tuned Triton skinny GEMM per (N, K, M bucket), else cuBLAS"
    targets = ("h100",)
    dtypes = (torch.bfloat16, torch.float16)
    default_on = False
    kernel_files = (
        "kernels_generated/skinny_gemm.py",
        "kernels_generated/configs/skinny_gemm.json",
    )

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        import kernels_generated.skinny_gemm  # noqa: F401  (registers ce_kernels ops)

        kernel = torch.ops.ce_kernels.skinny_linear.default
        nodes = bias_free_linears(graph)
        for node in nodes:
            node.target = kernel
            node.args, node.kwargs = (node.args[0], node.args[1]), {}
        return len(nodes)
