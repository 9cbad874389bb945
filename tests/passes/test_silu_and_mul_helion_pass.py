"""silu_and_mul_helion: one match per layer on h100 in bf16/fp16, off by default.

Named *_pass so that pytest does not confuse it with tests/kernels/test_silu_and_mul_helion.py
(test directories here are not packages, so basenames must differ). The numerics case runs
the Helion kernel eagerly, which needs HELION_INTERPRET=1 from the start of the process: it
runs in a child pytest (pass_kit.run_interpreted)."""

from __future__ import annotations

import os

import pytest
import torch

from compile_engine.passes.base import PassContext
from compile_engine.passes.registry import select

from pass_kit import (
    apply_pass,
    assert_numerics_unchanged,
    count_matches,
    make_model_dir,
    run_interpreted,
    targets_of,
)

pytest.importorskip("helion", reason="helion is not installed (pip install helion==1.4.0)")

LAYERS = 2  # tests/tiny_models
INTERPRETED = os.environ.get("HELION_INTERPRET") == "1"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_match_per_layer_on_h100(graph, dtype):
    ctx = PassContext("h100", dtype)
    assert count_matches("silu_and_mul_helion", graph, ctx) == LAYERS
    gm = apply_pass("silu_and_mul_helion", graph, ctx)
    targets = targets_of(gm)
    assert torch.ops.ce.silu_and_mul.default not in targets
    kernel = torch.ops.ce_kernels.silu_and_mul_helion.default
    assert targets.count(kernel) == LAYERS
    calls = [n for n in gm.graph.nodes if n.target is kernel]
    assert all(len(n.args) == 2 and n.args[-1] == ctx.kernel.key for n in calls)


@pytest.mark.parametrize(
    "ctx", [PassContext("cpu", torch.float32), PassContext("h100", torch.float32)]
)
def test_does_not_apply_elsewhere(graph, ctx):
    assert count_matches("silu_and_mul_helion", graph, ctx) == 0


def test_off_by_default_and_selectable():
    # Off until the H200 shows it beating Inductor's own fusion of the reference (issue 5).
    assert "silu_and_mul_helion" not in [p.name for p in select(None)]
    chosen = [p.name for p in select("+silu_and_mul_helion")]
    assert chosen.index("silu_and_mul_helion") < chosen.index("lower_to_reference")


@pytest.mark.interpreted_child("HELION_INTERPRET")
def test_interpreted_numerics_unchanged(tmp_path):
    # float16 on CPU: the pass applies to half precision only, and the eager kernel rounds
    # exactly as the reference does, so the tolerance stays the float32 one.
    directory = make_model_dir("llama", tmp_path)
    result = assert_numerics_unchanged(
        "silu_and_mul_helion", directory, target="h100", dtype=torch.float16
    )
    assert result["matches"] == LAYERS


@pytest.mark.skipif(INTERPRETED, reason="this is the parent of the interpreted run")
def test_interpreted_cases_in_subprocess():
    child = run_interpreted(__file__, "HELION_INTERPRET", "-k", "interpreted_numerics")
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-4000:]
    assert "1 passed" in child.stdout, child.stdout[-2000:]
