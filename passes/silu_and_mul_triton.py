"""silu_and_mul -> the plain Triton kernel (kernels_generated/silu_and_mul.py).

Matches: every `ce.silu_and_mul` node (one per decoder layer, between gate_up_proj and
down_proj) that no earlier pass claimed: silu_and_mul_helion is registered first, so with both
selected the Helion kernel wins. Emits: `ce_kernels.silu_and_mul`, an opaque custom op with the
same schema, launch configs per shape class from configs/silu_and_mul.json. Applies on h100.

Off by default: it does not beat Inductor's own fusion of the reference at every token count.
`bench fusions` on the H200, I = 14336 in bf16, CUDA-graph replay, two runs: x1.02 / x1.11 /
x1.23 / x0.97 and x0.98 / x1.25 / x1.70 / x1.29 over Inductor at T = 1 / 64 / 256 / 2048
(1.21 against 1.24 us at one token, the launch floor; 43.4 us at 2048 tokens against
Inductor's 42.1 and 56.3 us in the two runs). Select it with `--passes +silu_and_mul_triton`
(docs/compiler.md).
"""

from __future__ import annotations

import torch
from torch import fx

from passes.base import GraphPass, PassContext, op_nodes
from passes.registry import register


@register
class SiluAndMulTriton(GraphPass):
    name = "silu_and_mul_triton"
    description = "silu_and_mul -> plain Triton kernel (off: ties Inductor)"
    targets = ("h100",)
    default_on = False
    kernel_files = (
        "kernels_generated/silu_and_mul.py",
        "kernels_generated/configs/silu_and_mul.json",
    )

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        import kernels_generated.silu_and_mul  # noqa: F401  (registers ce_kernels ops)

        kernel = torch.ops.ce_kernels.silu_and_mul.default
        nodes = op_nodes(graph, "silu_and_mul")
        for node in nodes:
            node.target = kernel
        return len(nodes)
