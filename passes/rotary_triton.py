"""rotary -> the Triton kernel (kernels_generated/rotary.py).

Matches: every `ce.rotary` node (one per attention layer, between the QKV projection and
paged attention). Emits: `ce_kernels.rotary`, an opaque custom op with the same schema around
the Triton kernel, which rotates q and k in one launch, reading them as strided views of the
QKV output and the cos/sin row of each token's position, with launch configs per shape class
from configs/rotary.json. Applies on h100 in every dtype.

On by default: it beats Inductor's own fusion of the reference (what lower_to_reference hands
Inductor when this pass is off) at every token count. `bench fusions` on the H200, Llama-3-8B
heads (32 / 8 of 128) in bf16, CUDA-graph replay: 1.45 / 1.72 / 2.29 / 9.84 us against
Inductor's 2.64 / 3.50 / 5.14 / 23.75 us at T = 1 / 64 / 256 / 2048, x1.8 to x2.4, up to
4.4 TB/s where Inductor reaches 1.8 (benchmarks/results/fusions-*.json, docs/compiler.md).
"""

from __future__ import annotations

import torch
from torch import fx

from passes.base import GraphPass, PassContext, op_nodes
from passes.registry import register


@register
class RotaryTriton(GraphPass):
    name = "rotary_triton"
    description = "rotary -> Triton kernel, q and k in one launch (on: x1.8-2.4 vs Inductor)"
    targets = ("h100",)
    kernel_files = ("kernels_generated/rotary.py", "kernels_generated/configs/rotary.json")

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        import kernels_generated.rotary  # noqa: F401  (registers ce_kernels ops)

        kernel = torch.ops.ce_kernels.rotary.default
        nodes = op_nodes(graph, "rotary")
        for node in nodes:
            node.target = kernel
        return len(nodes)
