"""Paged attention on cpu -> the decode fast path (kernels_generated/paged_attention_cpu.py).

Matches: every `ce.paged_attention` on the cpu target. Emits: `ce_kernels.paged_attention_cpu`,
which runs a step whose sequences each have one new token (decode) in seven ATen calls and any
other step through the reference. Same schema, same split point (compiler/backend.py), same
numbers as the reference. On SmolLM2-135M (30 layers) a batch-1 decode step spent 14.7 of
~47 ms in the reference's attention (issue 29's profile).
"""

from __future__ import annotations

from torch import fx

from compile_engine.passes.base import GraphPass, PassContext, lower, op_nodes
from compile_engine.passes.registry import register


@register
class PagedAttentionCpu(GraphPass):
    name = "paged_attention_cpu"
    description = "paged_attention -> its decode-step fast path in few ATen calls (cpu)"
    targets = ("cpu",)
    kernel_files = (
        "kernels_generated/paged_attention_cpu.py",
        "kernels_generated/csrc/paged_decode_cpu.cpp",
        "kernels_generated/vnni_linear_cpu.py",
    )

    def applies(self, ctx: PassContext) -> bool:
        return ctx.target == "cpu"

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        import torch

        from compile_engine.kernels_generated.paged_attention_cpu import (  # registers
            decode_read_kernel,
            paged_attention_decode_cpu,
        )

        if ctx.decode_only:
            # Builds and loads the C++ read the decode graph may call, in every process that
            # runs it: where Inductor's caches serve the compiled graph, nothing else would.
            decode_read_kernel()
        # A decode graph inlines the attention (a plain function AOTAutograd traces into ATen
        # ops): no split, the whole step one piece. Else the op, a split point.
        kernel = (
            paged_attention_decode_cpu
            if ctx.decode_only
            else torch.ops.ce_kernels.paged_attention_cpu.default
        )
        nodes = op_nodes(graph, "paged_attention")
        for node in nodes:
            lower(node, kernel, ctx)
        return len(nodes)
