"""Lower every `ce` op that no other pass claimed to its plain-PyTorch reference.

Matches: rms_norm, add_rms_norm, rotary, silu_and_mul, moe_route, moe_combine (never
paged_attention, which is the split point of the piecewise graph). Emits: a call of the
reference function, which AOTAutograd traces into aten ops that Inductor fuses with their
neighbours (the norm's multiply into the residual add, the rotary into the QKV split, silu and
mul into one loop, the router's softmax and renormalisation around its top-k). Without this pass
Inductor would call each op as an opaque Python kernel. It runs last, after kernel passes.
"""

from __future__ import annotations

from torch import fx

from models import ops
from passes.base import GraphPass, PassContext, op_nodes
from passes.registry import register

# MoE: the router's softmax/top-k/renormalise and the weighted combine are sync-free and
# traceable; align and the grouped GEMMs are not lowered (the GEMM reference loops on the host)
# and stay opaque unless passes/moe_grouped_gemm.py replaces them.
LOWERED = ("rms_norm", "add_rms_norm", "rotary", "silu_and_mul", "moe_route", "moe_combine")


@register
class LowerToReference(GraphPass):
    name = "lower_to_reference"
    description = "ce ops -> their PyTorch reference, for Inductor to fuse (runs last)"

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        count = 0
        for op_name in LOWERED:
            reference = ops.OPS[op_name][1]
            for node in op_nodes(graph, op_name):
                node.target = reference
                count += 1
        return count
