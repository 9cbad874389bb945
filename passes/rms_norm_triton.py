"""rms_norm and residual-add + rms_norm -> the Triton kernel (kernels_generated/add_rms_norm.py).

Matches: every `ce.rms_norm` and `ce.add_rms_norm` node: in a Llama-family model the first
layer's input norm (no residual yet), the two add + norms of every layer after it, the final
add + norm, and Qwen3's q and k norms. Emits: `ce_kernels.rms_norm` / `ce_kernels.add_rms_norm`,
opaque custom ops with the same schemas around the Triton kernel (one row per program, float32
accumulation, both outputs of the add written in one pass), launch configs per shape class from
configs/add_rms_norm.json. Applies on h100 in every dtype (the kernel computes in float32).

Off by default: it does not beat Inductor's own fusion of the reference (what
lower_to_reference hands Inductor when this pass is off) at every token count. `bench fusions`
on the H200, add_rms_norm at hidden 4096 in bf16, CUDA-graph replay, two runs: x1.20 / x1.16 /
x1.12 / x1.00 and x1.03 / x1.01 / x1.01 / x0.95 over Inductor at T = 1 / 64 / 256 / 2048
(1.71 against 2.04 us at one token, 17.9 against 17.9 us at 2048, where both move ~3.7 TB/s).
The small-T gain is as large as Inductor's own run-to-run spread (1.80 to 2.04 us), and at
2048 tokens it ties or loses. Select it with `--passes +rms_norm_triton` (docs/compiler.md).
"""

from __future__ import annotations

import torch
from torch import fx

from compile_engine.passes.base import GraphPass, PassContext, lower, op_nodes
from compile_engine.passes.registry import register


@register
class RmsNormTriton(GraphPass):
    name = "rms_norm_triton"
    description = "rms_norm, add_rms_norm -> Triton kernel (off: ties Inductor)"
    targets = ("h100",)
    default_on = False
    kernel_files = (
        "kernels_generated/add_rms_norm.py",
        "kernels_generated/configs/add_rms_norm.json",
    )

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        # Imported here: listing passes or building for cpu must not import triton.
        import compile_engine.kernels_generated.add_rms_norm  # noqa: F401  (registers ce_kernels ops)

        count = 0
        for op_name in ("rms_norm", "add_rms_norm"):
            kernel = getattr(torch.ops.ce_kernels, op_name).default
            for node in op_nodes(graph, op_name):
                lower(node, kernel, ctx)
                count += 1
        return count
