"""paged_attention_triton: one match per layer on h100, none on cpu.

The kernel is tested in tests/kernels/test_paged_attention.py; it runs on CPU only under the
Triton interpreter, so here the pass's rewrite is checked in the graph without running it."""

from __future__ import annotations

import torch

from compile_engine.compiler.backend import host_sync_ops
from compile_engine.kernels_generated.tuning import KernelConfig
from compile_engine.passes.base import PassContext

from pass_kit import apply_pass, count_matches, targets_of

LAYERS = 2  # tests/tiny_models


def test_one_match_per_layer_on_h100(graph):
    ctx = PassContext("h100", torch.bfloat16, KernelConfig(pdl=False))
    assert count_matches("paged_attention_triton", graph, ctx) == LAYERS
    assert host_sync_ops(graph.graph) == ["paged_attention"]
    rewritten = apply_pass("paged_attention_triton", graph, ctx)
    targets = targets_of(rewritten)
    assert torch.ops.ce.paged_attention.default not in targets
    assert targets.count(torch.ops.ce_kernels.paged_attention.default) == LAYERS
    # The kernel op's last argument is the context's kernel config, by its key.
    kernel = torch.ops.ce_kernels.paged_attention.default
    keys = [n.args[-1] for n in rewritten.graph.nodes if n.target is kernel]
    assert keys == [ctx.kernel.key] * LAYERS
    # What lets the engine capture CUDA graphs: nothing left that syncs with the host.
    assert host_sync_ops(rewritten.graph) == []


def test_does_not_apply_on_cpu(graph):
    assert count_matches("paged_attention_triton", graph, PassContext("cpu", torch.float32)) == 0
