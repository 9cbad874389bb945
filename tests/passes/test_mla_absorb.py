"""mla_absorb: one match per DeepSeek layer on every target; the rewritten graph computes what
the naive up-projected graph computes.

On cpu the pass emits the reference latent op (plain PyTorch); on h100 the Triton kernel,
which runs on CPU only under the interpreter: that numerics case runs in a child pytest
(pass_kit.run_interpreted)."""

from __future__ import annotations

import os

import pytest
import torch

from compile_engine.compiler.backend import host_sync_ops, is_split_node, split_at_attention
from compile_engine.passes.base import PassContext
from compile_engine.passes.registry import select

from pass_kit import (
    apply_pass,
    assert_numerics_unchanged,
    capture_graph,
    count_matches,
    run_interpreted,
    targets_of,
)
from tiny_deepseek import make_tiny_deepseek

LAYERS = 3  # tests/tiny_deepseek
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("deepseek-v2-qlora")
    make_tiny_deepseek("deepseek-v2-qlora", directory)
    return directory


@pytest.fixture(scope="module")
def graph(model_dir):
    return capture_graph(model_dir=model_dir)


@pytest.mark.parametrize(
    "target, emitted",
    [("cpu", "ce::mla_latent_attention"), ("h100", "ce_kernels::mla_latent_attention")],
)
def test_one_match_per_layer(graph, target, emitted):
    ctx = PassContext(target, torch.bfloat16 if target == "h100" else torch.float32)
    assert count_matches("mla_absorb", graph, ctx) == LAYERS
    rewritten = apply_pass("mla_absorb", graph, ctx)
    targets = targets_of(rewritten)
    assert torch.ops.ce.mla_attention.default not in targets
    names = [t._schema.name for t in targets if isinstance(t, torch._ops.OpOverload)]
    assert names.count(emitted) == LAYERS
    # The kernel op takes the kernel config's key last; the reference op the schema alone.
    calls = [n for n in rewritten.graph.nodes if getattr(n.target, "_schema", None)
             and n.target._schema.name == emitted]  # fmt: skip
    if target == "h100":
        assert all(len(n.args) == 10 and n.args[-1] == ctx.kernel.key for n in calls)
    else:
        assert all(len(n.args) == 9 for n in calls)  # ce::mla_latent_attention's own schema
    # Capturable in a CUDA graph only where the kernel lowering replaced the reference.
    syncing = host_sync_ops(rewritten.graph)  # (the MoE layers' own op is another pass's)
    assert ("mla_latent_attention" in syncing) == (target == "cpu")
    assert "mla_attention" not in syncing
    # W_UK into the query before the attention op, W_UV after it: two einsums per layer.
    assert targets.count(torch.einsum) == 2 * LAYERS
    # The latent op is a split point: one attention piece per layer.
    _, attention = split_at_attention(rewritten)
    assert len(attention) == LAYERS
    assert sum(is_split_node(n) for n in rewritten.graph.nodes) == LAYERS


def test_on_by_default_before_lower_to_reference():
    chosen = [p.name for p in select(None)]
    assert chosen.index("mla_absorb") < chosen.index("lower_to_reference")


def test_does_not_touch_dense_models():
    llama = capture_graph("llama")
    assert count_matches("mla_absorb", llama, PassContext("cpu", torch.float32)) == 0


def test_numerics_unchanged_on_cpu(model_dir):
    result = assert_numerics_unchanged("mla_absorb", model_dir)
    assert result["matches"] == LAYERS


@pytest.mark.interpreted_child("TRITON_INTERPRET")
def test_interpreted_kernel_numerics_unchanged(model_dir):
    # The h100 rewrite, with the Triton kernel run by the interpreter on CPU tensors; short
    # sequences (prefill chunks, then decodes) keep the interpreted programs few.
    sequences = [[5, 9, 11, 17, 23, 29, 31], [37, 41, 43, 47]]
    result = assert_numerics_unchanged("mla_absorb", model_dir, target="h100", sequences=sequences)
    assert result["matches"] == LAYERS


@pytest.mark.skipif(INTERPRETED, reason="this is the parent of the interpreted run")
def test_interpreted_cases_in_subprocess():
    child = run_interpreted(__file__, "TRITON_INTERPRET", "-k", "interpreted_kernel_numerics")
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-4000:]
    assert "1 passed" in child.stdout, child.stdout[-2000:]
