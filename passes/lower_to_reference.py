"""Lower every `ce` op that no other pass claimed to its plain-PyTorch reference.

Matches: rms_norm, add_rms_norm, rotary, silu_and_mul, quantize_fp8 (an FP8 activation's
quantization, which quantized_gemm adds), all_reduce_add_rms_norm (never paged_attention,
which is the split point of the piecewise graph). Emits: a call of the reference function,
which AOTAutograd traces into aten ops (and functional collectives) that Inductor fuses with
their neighbours (the norm's multiply into the residual add, the rotary into the QKV split,
silu and mul into one loop). Without this pass Inductor would call each op as an opaque Python
kernel. It runs last, after kernel passes.
"""

from __future__ import annotations

from torch import fx

from compile_engine.models import vocabulary
from compile_engine.passes.base import GraphPass, PassContext, op_nodes
from compile_engine.passes.registry import register

LOWERED = (
    "rms_norm",
    "add_rms_norm",
    "rotary",
    "silu_and_mul",
    "quantize_fp8",
    "all_reduce_add_rms_norm",
)


@register
class LowerToReference(GraphPass):
    name = "lower_to_reference"
    description = "ce ops -> their PyTorch reference, for Inductor to fuse (runs last)"

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        count = 0
        for op_name in LOWERED:
            reference = vocabulary.OPS[op_name][1]
            for node in op_nodes(graph, op_name):
                node.target = reference
                count += 1
        return count
