"""rotary -> the Triton kernel (kernels_generated/rotary.py).

Matches: every `ce.rotary` node (one per attention layer, between the QKV projection and
paged attention). Emits: `ce_kernels.rotary`, an opaque custom op with the same schema around
the Triton kernel, which rotates q and k in one launch, reading them as strided views of the
QKV output and the cos/sin row of each token's position, with launch configs per shape class
from configs/rotary.json. Applies on h100 in every dtype.

On by default: it beats Inductor's own fusion of the reference (what lower_to_reference hands
Inductor when this pass is off) at every token count. `bench fusions` on the H200, Llama-3-8B
heads (32 / 8 of 128) in bf16, CUDA-graph replay, at 7a4cda9: 1.44 / 1.70 / 2.28 / 9.83 us
against Inductor's 2.56 / 3.41 / 5.79 / 29.30 us at T = 1 / 64 / 256 / 2048, x1.78 / x2.01 /
x2.54 / x2.98 (x1.81 / x2.03 / x2.24 / x2.42 in a first run), 4.4 TB/s at 2048 tokens where
Inductor reaches 1.5. With it on, the 4-layer Llama-3-8B-shaped model in bf16 still agrees
with HF bf16 (tests/gpu/test_h100.py: logits cosine 0.99989, top-1 0.973).
"""

from __future__ import annotations

import torch
from torch import fx

from compile_engine.passes.base import GraphPass, PassContext, lower, op_nodes
from compile_engine.passes.registry import register


@register
class RotaryTriton(GraphPass):
    name = "rotary_triton"
    description = "rotary -> Triton kernel, q and k in one launch (on: x1.8-3.0 vs Inductor)"
    targets = ("h100",)
    kernel_files = ("kernels_generated/rotary.py", "kernels_generated/configs/rotary.json")

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        import compile_engine.kernels_generated.rotary  # noqa: F401  (registers ce_kernels ops)

        kernel = torch.ops.ce_kernels.rotary.default
        nodes = op_nodes(graph, "rotary")
        for node in nodes:
            lower(node, kernel, ctx)
        return len(nodes)
