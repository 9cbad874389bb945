"""rotary_triton: one match per layer on h100, none on cpu; numerics with it off.

The numerics case runs the Triton kernel, which on CPU needs TRITON_INTERPRET=1 from the
start of the process: it runs in the child pytest that test_triton_passes_interpreted.py
starts. The pass decides from the context only, so a context of h100 rewrites the graph while
the tensors stay on CPU."""

from __future__ import annotations

import pytest
import torch

from compile_engine.passes.base import PassContext
from compile_engine.passes.registry import select

from pass_kit import (
    apply_pass,
    assert_numerics_unchanged,
    count_matches,
    make_model_dir,
    targets_of,
)

LAYERS = 2  # tests/tiny_models


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_one_match_per_layer_on_h100(graph, dtype):
    ctx = PassContext("h100", dtype)
    assert count_matches("rotary_triton", graph, ctx) == LAYERS
    gm = apply_pass("rotary_triton", graph, ctx)
    targets = targets_of(gm)
    assert torch.ops.ce.rotary.default not in targets
    assert targets.count(torch.ops.ce_kernels.rotary.default) == LAYERS
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.ce_kernels.rotary.default]
    assert all(len(n.args) == 5 and n.args[-1] == ctx.kernel.key for n in calls)


def test_does_not_apply_on_cpu(graph):
    assert count_matches("rotary_triton", graph, PassContext("cpu", torch.float32)) == 0


def test_on_by_default_and_removable():
    # On: x1.8-2.4 over Inductor's fusion of the reference on the H200 (docs/compiler.md).
    chosen = [p.name for p in select(None)]
    assert chosen.index("rotary_triton") < chosen.index("lower_to_reference")
    assert "rotary_triton" not in [p.name for p in select("-rotary_triton")]


@pytest.mark.interpreted_child("TRITON_INTERPRET")
def test_interpreted_numerics_unchanged(tmp_path):
    # float16: the kernel rounds exactly where the reference does, so the float32 tolerance
    # holds in half precision too, and half precision is what the GPU serves.
    directory = make_model_dir("llama", tmp_path)
    result = assert_numerics_unchanged(
        "rotary_triton", directory, target="h100", dtype=torch.float16
    )
    assert result["matches"] == LAYERS
