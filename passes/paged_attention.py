"""Paged-attention gather -> the Triton kernel that reads KV blocks in place.

Matches: every `ce.paged_attention` (the model's reference: write K/V through the slot
mapping, gather each sequence's blocks, masked SDPA). Emits: `ce_kernels.paged_attention`
(kernels_generated/paged_attention/), one launch per layer for the whole packed batch, with
the KV write fused, no gathered copy, no host synchronisation, its grid sized from tensor
shapes only, which is what lets the runner capture whole-model CUDA graphs for mixed batches.
Applies on h100 (sm_90) only: on CPU the reference is the faster path.
"""

from __future__ import annotations

from torch import fx

from compile_engine.passes.base import GraphPass, PassContext, lower, op_nodes
from compile_engine.passes.registry import register


@register
class PagedAttentionKernel(GraphPass):
    name = "paged_attention_triton"
    description = "paged_attention gather+SDPA -> Triton kernel reading KV blocks in place"
    targets = ("h100",)

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        import torch

        import compile_engine.kernels_generated.paged_attention  # noqa: F401  (registers ce_kernels ops)

        kernel = torch.ops.ce_kernels.paged_attention.default
        nodes = op_nodes(graph, "paged_attention")
        for node in nodes:
            lower(node, kernel, ctx)
        return len(nodes)
