"""rotary -> the Triton kernel (kernels_generated/rotary.py).

Matches: every `ce.rotary` node (one per attention layer, between the QKV projection and
paged attention). Emits: `ce_kernels.rotary`, an opaque custom op with the same schema around
the Triton kernel, which rotates q and k in one launch, reading them as strided views of the
QKV output and the cos/sin row of each token's position, with launch configs per shape class
from configs/rotary.json. Applies on h100 in every dtype.

Default: decided by `bench fusions` on the H200 against Inductor's own fusion of the reference
(which lower_to_reference hands it when this pass is off); see docs/compiler.md for the numbers.
"""

from __future__ import annotations

import torch
from torch import fx

from passes.base import GraphPass, PassContext, op_nodes
from passes.registry import register


@register
class RotaryTriton(GraphPass):
    name = "rotary_triton"
    description = "rotary -> Triton kernel rotating q and k in one launch"
    targets = ("h100",)
    default_on = False
    kernel_files = ("kernels_generated/rotary.py", "kernels_generated/configs/rotary.json")

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        import kernels_generated.rotary  # noqa: F401  (registers ce_kernels ops)

        kernel = torch.ops.ce_kernels.rotary.default
        nodes = op_nodes(graph, "rotary")
        for node in nodes:
            node.target = kernel
        return len(nodes)
