"""Bias-free linear layers -> the tuned skinny GEMM (kernels_generated/skinny_gemm.py).

Matches: every `F.linear(x, w)` call without a bias in the captured graph (Dynamo records
`torch._C._nn.linear`; in a Llama-family model qkv_proj, o_proj, gate_up_proj and down_proj of
every layer; lm_head runs outside the graph, in compute_logits). A linear with a bias (Qwen2's
qkv) is left to Inductor. Emits: `ce_kernels.skinny_linear(x, w)`, an opaque custom op that
runs, per call, what won the H200 sweep for the weight's exact (N, K) and the row count's
power-of-two bucket (configs/skinny_gemm.json): the Triton skinny GEMM with its tuned config,
cuBLASLt (torch's preferred BLAS library switched for that call), or cuBLAS (F.linear) where
neither beat it by 5%, where the shape was never tuned, or above 256 rows. Inside a CUDA graph
the choice is made once, at capture, so the per-call Python cost only touches steps that run
without a graph (prefills above the largest captured size, which go straight to cuBLAS).
Applies on h100 in bf16/fp16. Weights stay as the checkpoint lays them out ([N, K], K
contiguous): a transposed [K, N] copy sped cuBLAS up by more than 5% only on lm_head at
M = 32-64, and slowed gate_up at M = 128 from 66 to 105 us.

On by default: every choice other than cuBLAS beat cuBLAS by at least 5% per call, and
everywhere else it calls the same cuBLAS GEMM as before. `bench gemm` on the H200 at d813e66,
Llama-3-8B weights in bf16, CUDA-graph replay over weight copies that miss L2:
- Triton: o_proj [4096, 4096] 11.2-11.4 us against cuBLAS's 13.3-13.7 us at M = 1..16
  (x1.19-1.20, 3.0 TB/s); qkv [6144, 4096] 14.7-15.6 against 15.7-16.5 us at M = 1, 4, 16
  (x1.05-1.07, up to 3.4 TB/s).
- cuBLASLt: down_proj [4096, 14336] 31.3 against 36.1 us at M = 64 (x1.15; cuBLAS splits K
  and adds a reduce kernel) and 30.5 against 33.3 at 32; o_proj 11.3 against 14.0 at 32;
  gate_up 58.1 against 61.1 at 64 (x1.05). In a first sweep (0c3e337) the down_proj and
  o_proj cells won too (x1.08-1.18), gate_up at 64 by x1.04.
- gate_up and down_proj at M <= 16 (cuBLAS at 3.7-4.2 TB/s) and everything at M >= 128 stay on
  cuBLAS.
Per decode step that is ~0.1 ms of 4.4 ms at batch 1 and ~0.25 ms of 5.0 ms at batch 64
(sums of the per-call gains over 32 layers); nothing at 256. `bench latency` with the pass on
at d813e66 (the Triton entries only, before the cuBLASLt ones were added): 227.1 / 12,805 /
28,850 tok/s at batch 1 / 64 / 256; not an A/B, the pass-off run of that tree is still to be
measured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

from compile_engine.passes.base import GraphPass, PassContext, lower
from compile_engine.passes.registry import register


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
    description = "bias-free linear -> tuned Triton skinny GEMM / cuBLASLt / cuBLAS per shape (on)"
    targets = ("h100",)
    dtypes = (torch.bfloat16, torch.float16)
    kernel_files = (
        "kernels_generated/skinny_gemm.py",
        "kernels_generated/counters.py",
        "kernels_generated/configs/skinny_gemm.json",
    )

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        import compile_engine.kernels_generated.skinny_gemm  # noqa: F401  (registers ce_kernels ops)

        kernel = torch.ops.ce_kernels.skinny_linear.default
        nodes = bias_free_linears(graph)
        for node in nodes:
            node.args, node.kwargs = (node.args[0], node.args[1]), {}
            lower(node, kernel, ctx)
        return len(nodes)
