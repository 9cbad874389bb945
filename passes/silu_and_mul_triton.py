"""silu_and_mul -> the plain Triton kernel (kernels_generated/silu_and_mul.py).

Matches: every `ce.silu_and_mul` node (one per decoder layer, between gate_up_proj and
down_proj) that no earlier pass claimed: silu_and_mul_helion is registered first, so with both
selected the Helion kernel wins. Emits: `ce_kernels.silu_and_mul`, an opaque custom op with the
same schema, launch configs per shape class from configs/silu_and_mul.json. Applies on h100.

On by default on h100 since the engine measured it: `bench breakdown --kernels` on the H200
(Llama-3-8B shape, bf16, the whole model as one CUDA graph, the gate_up output fresh from its
GEMM; at 5e4bab7 plus the paged-attention own-key change) timed this kernel at 50.9 / 73.3 /
195.7 us a step (32 layers) against 49.3 / 95.5 / 286.4 for Inductor's fusion of the
reference at batch 1 / 64 / 256, and the graph's replay at 4.139 / 4.452 / 7.700 ms against
4.163 / 4.487 / 7.742. Alone (`bench fusions`, I = 14336, bf16, CUDA-graph replay, two runs,
the input left in L2 by the previous call) it was x1.02 / x1.11 / x1.23 / x0.97 and x0.98 /
x1.25 / x1.70 / x1.29 over Inductor at T = 1 / 64 / 256 / 2048.
`--passes -silu_and_mul_triton` leaves the op to Inductor (docs/compiler.md).
"""

from __future__ import annotations

import torch
from torch import fx

from compile_engine.passes.base import GraphPass, PassContext, lower, op_nodes
from compile_engine.passes.registry import register


@register
class SiluAndMulTriton(GraphPass):
    name = "silu_and_mul_triton"
    description = "silu_and_mul -> plain Triton kernel"
    targets = ("h100",)
    default_on = True
    kernel_files = (
        "kernels_generated/silu_and_mul.py",
        "kernels_generated/configs/silu_and_mul.json",
    )

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        import compile_engine.kernels_generated.silu_and_mul  # noqa: F401  (registers ce_kernels ops)

        kernel = torch.ops.ce_kernels.silu_and_mul.default
        nodes = op_nodes(graph, "silu_and_mul")
        for node in nodes:
            lower(node, kernel, ctx)
        return len(nodes)
