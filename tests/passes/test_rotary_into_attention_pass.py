"""rotary_into_attention: one match per layer on h100 (each layer's rotary and attention become
one node), none on cpu; numerics unchanged with it, and the graph still splits at attention.

The numerics case runs the Triton kernel, which on CPU needs TRITON_INTERPRET=1 from the
start of the process: it runs in the child pytest that test_triton_passes_interpreted.py
starts. The pass decides from the context only, so a context of h100 rewrites the graph while
the tensors stay on CPU."""

from __future__ import annotations

import operator

import pytest
import torch

from compile_engine.compiler.backend import is_split_node
from compile_engine.passes.base import PassContext
from compile_engine.passes.registry import select

from pass_kit import (
    apply_pass,
    assert_numerics_unchanged,
    copy_graph,
    count_matches,
    make_model_dir,
    targets_of,
)

LAYERS = 2  # tests/tiny_models


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_one_match_per_layer_on_h100(graph, dtype):
    ctx = PassContext("h100", dtype)
    assert count_matches("rotary_into_attention", graph, ctx) == LAYERS
    rewritten = apply_pass("rotary_into_attention", graph, ctx)
    targets = targets_of(rewritten)
    assert torch.ops.ce.rotary.default not in targets
    assert torch.ops.ce.paged_attention.default not in targets
    assert targets.count(torch.ops.ce_kernels.paged_attention_rotary.default) == LAYERS
    # The fused node is where the backend splits the graph, as attention was.
    assert sum(is_split_node(n) for n in rewritten.graph.nodes) == LAYERS
    # Its q and k are the QKV projection's views, not a rotary's outputs.
    # Its last argument is the kernel config's key.
    for node in rewritten.graph.nodes:
        if node.target is torch.ops.ce_kernels.paged_attention_rotary.default:
            assert node.args[0].target is not operator.getitem
            assert node.args[-1] == ctx.kernel.key


def test_leaves_a_rotary_with_other_users(graph):
    # A rotated q that something besides attention reads keeps its rotary node (the pass
    # counts matches before dead code goes).
    gm = copy_graph(graph)
    rotary = next(n for n in gm.graph.nodes if n.target is torch.ops.ce.rotary.default)
    q = next(u for u in rotary.users if u.args[1] == 0)
    with gm.graph.inserting_after(q):
        gm.graph.call_function(torch.ops.aten.clone.default, (q,))
    assert count_matches("rotary_into_attention", gm, PassContext("h100", torch.bfloat16)) == (
        LAYERS - 1
    )


def test_does_not_apply_on_cpu(graph):
    assert count_matches("rotary_into_attention", graph, PassContext("cpu", torch.float32)) == 0


def test_default_passes_leave_rotary_triton_nothing(graph):
    # The fused layers' rotary nodes are dead after the rewrite: rotary_triton, which runs
    # later, must not retarget (and count) them.
    from compile_engine.passes.manager import PassManager

    manager = PassManager(select(None), PassContext("h100", torch.bfloat16))
    manager(copy_graph(graph).graph)
    assert manager.match_counts["rotary_into_attention"] == LAYERS
    assert manager.match_counts["rotary_triton"] == 0


def test_on_by_default_before_the_passes_it_preempts():
    chosen = [p.name for p in select(None)]
    assert chosen.index("rotary_into_attention") < chosen.index("paged_attention_triton")
    assert chosen.index("rotary_into_attention") < chosen.index("rotary_triton")
    assert "rotary_into_attention" not in [p.name for p in select("-rotary_into_attention")]


@pytest.mark.interpreted_child("TRITON_INTERPRET")
def test_interpreted_numerics_unchanged(tmp_path):
    # float32: with the pass the attention is the Triton kernel's, without it the reference's
    # SDPA, whose half-precision sums round differently (the kernel tests compare the fused
    # kernel with the reference in half precision, the written cache bit for bit).
    directory = make_model_dir("llama", tmp_path)
    result = assert_numerics_unchanged(
        "rotary_into_attention", directory, target="h100", dtype=torch.float32
    )
    assert result["matches"] == LAYERS
