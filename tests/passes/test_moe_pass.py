"""moe_grouped_gemm: one match per sparse MoE layer on h100, none on cpu; with the pass on,
logits equal those of the reference ops (kernel run by the Triton interpreter, float32)."""

from __future__ import annotations

import pytest
import torch

from compile_engine.compiler.backend import host_sync_ops
from compile_engine.passes.base import PassContext

from pass_kit import (
    apply_pass,
    assert_numerics_unchanged,
    capture_graph,
    count_matches,
    run_interpreted,
    targets_of,
)
from tiny_moe import make_tiny_moe

SPARSE_LAYERS = 2  # tiny qwen2_moe: layers 0 and 2 sparse, layer 1 dense (mlp_only_layers)
interpreted = pytest.mark.interpreted_child("TRITON_INTERPRET")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2_moe")
    make_tiny_moe("qwen2_moe", directory)
    return directory


@pytest.fixture(scope="module")
def graph(model_dir):
    return capture_graph(model_dir=model_dir)


def test_one_match_per_sparse_layer_on_h100(graph):
    ctx = PassContext("h100", torch.bfloat16)
    assert count_matches("moe_grouped_gemm", graph, ctx) == SPARSE_LAYERS
    assert "moe_grouped_gemm" in host_sync_ops(graph.graph)
    rewritten = apply_pass("moe_grouped_gemm", graph, ctx)
    assert "moe_grouped_gemm" not in host_sync_ops(rewritten.graph)  # capturable
    targets = targets_of(rewritten)
    kernel = torch.ops.ce_kernels.moe_fused_experts.default
    assert targets.count(kernel) == SPARSE_LAYERS
    calls = [n for n in rewritten.graph.nodes if n.target is kernel]
    assert all(len(n.args) == 6 and n.args[-1] == ctx.kernel.key for n in calls)
    for gone in ("moe_align", "moe_grouped_gemm", "moe_combine"):
        assert getattr(torch.ops.ce, gone).default not in targets, gone
    # The router stays for Inductor; the dense layer's and shared experts' silu_and_mul too.
    assert targets.count(torch.ops.ce.moe_route.default) == SPARSE_LAYERS
    assert targets.count(torch.ops.ce.silu_and_mul.default) == 1 + SPARSE_LAYERS


def test_does_not_apply_on_cpu(graph):
    assert count_matches("moe_grouped_gemm", graph, PassContext("cpu", torch.float32)) == 0


@interpreted
def test_numerics_unchanged_with_the_kernel(model_dir):
    result = assert_numerics_unchanged("moe_grouped_gemm", model_dir, target="h100")
    assert result["matches"] == SPARSE_LAYERS


@pytest.mark.slow
def test_interpreter_cases_in_subprocess():
    import compile_engine.kernels_generated.moe_grouped_gemm as mk

    if mk.INTERPRETED:
        pytest.skip("this session is interpreted already: the CPU cases ran in-process")
    proc = run_interpreted(__file__, "TRITON_INTERPRET", "-k", "numerics")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " skipped" not in proc.stdout.splitlines()[-1]
