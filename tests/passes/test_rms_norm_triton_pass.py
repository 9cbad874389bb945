"""rms_norm_triton: every rms_norm / add_rms_norm on h100, none on cpu; numerics with it off.

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
    capture_graph,
    count_matches,
    make_model_dir,
    targets_of,
)

LAYERS = 2  # tests/tiny_models
H100 = PassContext("h100", torch.bfloat16)


def expected_matches(arch: str) -> int:
    # Two norms per layer plus the final one; Qwen3 adds a q norm and a k norm per layer.
    return 2 * LAYERS + 1 + (2 * LAYERS if arch == "qwen3" else 0)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def traced(request):
    return request.param, capture_graph(request.param)


def test_every_norm_matches_on_h100(traced):
    arch, graph = traced
    assert count_matches("rms_norm_triton", graph, H100) == expected_matches(arch)
    targets = targets_of(apply_pass("rms_norm_triton", graph, H100))
    assert torch.ops.ce.rms_norm.default not in targets
    assert torch.ops.ce.add_rms_norm.default not in targets
    # The first layer's input norm has no residual yet; every later norm adds one.
    first = 1 + (2 * LAYERS if arch == "qwen3" else 0)
    assert targets.count(torch.ops.ce_kernels.rms_norm.default) == first
    assert targets.count(torch.ops.ce_kernels.add_rms_norm.default) == 2 * LAYERS
    # Each kernel op takes its ce op's arguments, then the kernel config's key.
    gm = apply_pass("rms_norm_triton", graph, H100)
    kernels = (torch.ops.ce_kernels.rms_norm.default, torch.ops.ce_kernels.add_rms_norm.default)
    calls = [n for n in gm.graph.nodes if n.target in kernels]
    assert all(n.args[-1] == H100.kernel.key and not n.kwargs for n in calls)


def test_does_not_apply_on_cpu(traced):
    _, graph = traced
    assert count_matches("rms_norm_triton", graph, PassContext("cpu", torch.float32)) == 0


def test_off_by_default_and_selectable():
    # Off: it ties Inductor's fusion of the reference on the H200 (docs/compiler.md).
    assert "rms_norm_triton" not in [p.name for p in select(None)]
    chosen = [p.name for p in select("+rms_norm_triton")]
    assert chosen.index("rms_norm_triton") < chosen.index("lower_to_reference")


@pytest.mark.interpreted_child("TRITON_INTERPRET")
def test_interpreted_numerics_unchanged(tmp_path):
    # Llama only: each model costs the child seconds, and Qwen3's q/k norms (3-D strided rows)
    # are checked against the reference in tests/kernels/test_add_rms_norm.py.
    directory = make_model_dir("llama", tmp_path)
    result = assert_numerics_unchanged("rms_norm_triton", directory, target="h100")
    assert result["matches"] == expected_matches("llama")
