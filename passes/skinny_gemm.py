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

On by default: where it runs the Triton kernel it beats cuBLAS by at least 5% per call (the
tuning rule), and everywhere else it calls the same cuBLAS GEMM as before. `bench gemm` on the
H200 at d813e66, Llama-3-8B weights in bf16, CUDA-graph replay over weight copies that miss
L2: o_proj [4096, 4096] 11.2-11.4 us against cuBLAS's 13.3-13.7 us at M = 1..16 (x1.19-1.20,
3.0 TB/s), 12.5 against 14.0 us at 32; qkv [6144, 4096] 14.7-15.6 against 15.7-16.5 us at
M = 1, 4, 16 (x1.05-1.07, up to 3.4 TB/s). gate_up and down_proj (cuBLAS at 3.7-4.2 TB/s)
and M >= 64 stay on cuBLAS: the kernel ties or loses there. That is ~0.1 ms of a 4.4 ms
batch-1 step and nothing at batch 64 or 256. `bench latency` with the pass on, same commit:
227.1 / 12,805 / 28,850 tok/s at batch 1 / 64 / 256 (not an A/B: the pass-off run of that
tree is still to be measured).
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
    description = "bias-free linear -> Triton skinny GEMM where tuned faster, else cuBLAS (on)"
    targets = ("h100",)
    dtypes = (torch.bfloat16, torch.float16)
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
