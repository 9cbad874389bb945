"""lower_to_reference: counts on traced tiny models, numerics with the pass off."""

from __future__ import annotations

import pytest
import torch

from compile_engine.models import ops
from compile_engine.passes.base import PassContext

from pass_kit import (
    apply_pass,
    assert_numerics_unchanged,
    capture_graph,
    count_matches,
    make_model_dir,
    targets_of,
)

CPU = PassContext("cpu", torch.float32)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def traced(request, tmp_path_factory):
    directory = make_model_dir(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, directory, capture_graph(model_dir=directory)


def expected_matches(arch: str, layers: int = 2) -> int:
    # Two norms per layer plus the final one, rotary and silu_and_mul per layer; Qwen3 adds a
    # q norm and a k norm per layer.
    return (2 * layers + 1) + 2 * layers + (2 * layers if arch == "qwen3" else 0)


def test_match_counts(traced):
    arch, _, graph = traced
    assert count_matches("lower_to_reference", graph, CPU) == expected_matches(arch)
    # The same graph on the GPU target: this pass applies everywhere.
    h100 = PassContext("h100", torch.bfloat16)
    assert count_matches("lower_to_reference", graph, h100) == expected_matches(arch)


def test_rewritten_graph_calls_references_not_ops(traced):
    _, _, graph = traced
    targets = targets_of(apply_pass("lower_to_reference", graph, CPU))
    for name in ("rms_norm", "add_rms_norm", "rotary", "silu_and_mul"):
        assert getattr(torch.ops.ce, name).default not in targets
    assert ops.silu_and_mul_ref in targets
    # Attention stays an op: it is where the graph splits.
    assert torch.ops.ce.paged_attention.default in targets


def test_numerics_unchanged(traced):
    _, directory, _ = traced
    result = assert_numerics_unchanged("lower_to_reference", directory)
    assert result["matches"] > 0


@pytest.mark.slow
def test_numerics_unchanged_under_inductor(tmp_path):
    # Inductor fuses the lowered references with their neighbours; the fused loops must keep
    # float32 numerics within 1e-4 of the opaque ops.
    directory = make_model_dir("llama", tmp_path)
    assert_numerics_unchanged("lower_to_reference", directory, inductor=True)
