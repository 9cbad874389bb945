"""silu_and_mul_triton: one match per layer on h100, none on cpu, none left once the Helion
pass (registered first) has claimed them; numerics with it off.

The numerics case runs the Triton kernel, which on CPU needs TRITON_INTERPRET=1 from the
start of the process: it runs in the child pytest that test_triton_passes_interpreted.py
starts. The pass decides from the context only, so a context of h100 rewrites the graph while
the tensors stay on CPU."""

from __future__ import annotations

import pytest
import torch

from compile_engine.passes.base import PassContext
from compile_engine.passes.manager import PassManager
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
    assert count_matches("silu_and_mul_triton", graph, ctx) == LAYERS
    gm = apply_pass("silu_and_mul_triton", graph, ctx)
    targets = targets_of(gm)
    assert torch.ops.ce.silu_and_mul.default not in targets
    kernel = torch.ops.ce_kernels.silu_and_mul.default
    assert targets.count(kernel) == LAYERS
    calls = [n for n in gm.graph.nodes if n.target is kernel]
    assert all(len(n.args) == 2 and n.args[-1] == ctx.kernel.key for n in calls)


def test_does_not_apply_on_cpu(graph):
    assert count_matches("silu_and_mul_triton", graph, PassContext("cpu", torch.float32)) == 0


def test_helion_pass_claims_first(graph):
    pytest.importorskip("helion", reason="helion is not installed")
    both = [p for p in select("+silu_and_mul_triton,+silu_and_mul_helion") if "silu" in p.name]
    manager = PassManager(both, PassContext("h100", torch.bfloat16))
    manager(copy_graph(graph).graph)
    # Registration order is application order: Helion takes every node, Triton finds none.
    assert manager.match_counts == {"silu_and_mul_helion": LAYERS, "silu_and_mul_triton": 0}


def test_on_by_default_and_deselectable():
    # On: in the engine it beats Inductor's fusion of the reference on the H200 (the pass's
    # docstring); it must run before lower_to_reference takes the op.
    chosen = [p.name for p in select(None)]
    assert chosen.index("silu_and_mul_triton") < chosen.index("lower_to_reference")
    assert "silu_and_mul_triton" not in [p.name for p in select("-silu_and_mul_triton")]


@pytest.mark.interpreted_child("TRITON_INTERPRET")
def test_interpreted_numerics_unchanged(tmp_path):
    # float32: in half precision exp's last float32 bit (the interpreter's numpy against
    # ATen's) flips a rounding now and then, one ulp of float16 that reaches the logits at
    # ~1e-3; the kernel test checks half precision against the reference element by element.
    directory = make_model_dir("llama", tmp_path)
    result = assert_numerics_unchanged("silu_and_mul_triton", directory, target="h100")
    assert result["matches"] == LAYERS
