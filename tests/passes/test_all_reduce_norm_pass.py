"""all_reduce_norm: on a tensor-parallel shard, every all-reduce feeding an add_rms_norm
becomes one all_reduce_add_rms_norm node; numerics unchanged with it on.

A one-rank gloo group in this process is enough: the shard's graph has the same collectives
as on any group size (the multi-process runs are tests/distributed/)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from compile_engine.models.parallel import TensorParallel
from compile_engine.passes.base import PassContext
from compile_engine.passes.pipeline import ORDER

from pass_kit import (
    apply_pass,
    assert_numerics_unchanged,
    capture_graph,
    count_matches,
    make_model_dir,
    targets_of,
)

LAYERS = 2  # tests/tiny_models
CPU = PassContext("cpu", torch.float32)


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    store = tmp_path_factory.mktemp("tp") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield TensorParallel(0, 1, dist.group.WORLD.group_name)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir("llama", tmp_path_factory.mktemp("llama"))


def test_every_reduce_into_a_norm_matches(shard, model_dir):
    graph = capture_graph(model_dir=model_dir, parallel=shard)
    c10d = torch.ops._c10d_functional
    before = targets_of(graph)
    # Embedding, o_proj and down_proj of each layer reduce; lm_head runs outside the graph.
    assert before.count(c10d.all_reduce.default) == 1 + 2 * LAYERS
    # Each layer's o_proj and down_proj reduce into a norm (the last into the final norm).
    assert count_matches("all_reduce_norm", graph, CPU) == 2 * LAYERS
    after = targets_of(apply_pass("all_reduce_norm", graph, CPU))
    assert after.count(torch.ops.ce.all_reduce_add_rms_norm.default) == 2 * LAYERS
    assert torch.ops.ce.add_rms_norm.default not in after
    # The embedding's reduce feeds the first norm, which has no residual: left alone.
    assert after.count(c10d.all_reduce.default) == 1


def test_nothing_to_match_without_tensor_parallelism(graph):
    assert count_matches("all_reduce_norm", graph, CPU) == 0


def test_h100_is_not_a_target_until_a_fused_kernel_exists(shard, model_dir):
    graph = capture_graph(model_dir=model_dir, parallel=shard)
    assert count_matches("all_reduce_norm", graph, PassContext("h100", torch.bfloat16)) == 0


def test_runs_before_the_passes_that_take_the_norm():
    for later in ("add_rms_norm_into_gemm", "rms_norm_triton", "lower_to_reference"):
        assert ORDER.index("all_reduce_norm") < ORDER.index(later)


def test_numerics_unchanged(shard, model_dir):
    result = assert_numerics_unchanged("all_reduce_norm", model_dir, parallel=shard)
    assert result["matches"] == 2 * LAYERS
