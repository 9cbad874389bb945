"""add_rms_norm_into_gemm: which norms it takes on h100 in half precision (those feeding a
bias-free linear), none elsewhere; numerics with it off, the fused kernel really running (a
table tuned for the tiny model's weights).

The numerics case runs the Triton kernel, which on CPU needs TRITON_INTERPRET=1 from the start
of the process: it runs in the child that tests/kernels/test_skinny_gemm.py starts."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F

from compile_engine.passes.base import PassContext
from compile_engine.passes.registry import select

from pass_kit import (
    apply_pass,
    count_matches,
    make_model_dir,
    targets_of,
)

LAYERS = 2  # tests/tiny_models
# Layer 0's input norm has no residual yet (rms_norm) and the final norm feeds lm_head outside
# the graph: the post-attention norm of every layer and the input norm of the others.
MATCHES = 2 * LAYERS - 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_takes_every_norm_that_feeds_a_linear(graph, dtype):
    ctx = PassContext("h100", dtype)
    assert count_matches("add_rms_norm_into_gemm", graph, ctx) == MATCHES
    targets = targets_of(apply_pass("add_rms_norm_into_gemm", graph, ctx))
    fused = torch.ops.ce_kernels.add_rms_norm_linear.default
    assert targets.count(fused) == MATCHES
    assert targets.count(torch.ops.ce.add_rms_norm.default) == 1  # the final norm
    # 4 linears a layer, one of them now inside each fused op; every silu_and_mul in gate_up's.
    assert targets.count(F.linear) == 4 * LAYERS - MATCHES
    assert torch.ops.ce.silu_and_mul.default not in targets
    assert operator.getitem in targets
    gm = apply_pass("add_rms_norm_into_gemm", graph, ctx)
    calls = [n for n in gm.graph.nodes if n.target is fused]
    gated = [n.args[5] for n in calls]
    assert sorted(gated) == [False] + [True] * LAYERS  # qkv_proj of layer 1; both gate_ups
    assert [n.args[6] for n in calls] == [ctx.kernel.key] * MATCHES  # the last argument


@pytest.mark.parametrize(
    "ctx", [PassContext("cpu", torch.float32), PassContext("h100", torch.float32)]
)
def test_does_not_apply_on_cpu_or_in_float32(graph, ctx):
    assert count_matches("add_rms_norm_into_gemm", graph, ctx) == 0


def test_on_by_default_and_before_the_passes_it_would_race():
    assert "add_rms_norm_into_gemm" in [p.name for p in select(None)]
    chosen = [p.name for p in select("+rms_norm_triton")]
    assert chosen.index("add_rms_norm_into_gemm") < chosen.index("rms_norm_triton")
    assert chosen.index("add_rms_norm_into_gemm") < chosen.index("skinny_gemm")


@pytest.mark.interpreted_child("TRITON_INTERPRET")
def test_interpreted_numerics_unchanged(tmp_path, monkeypatch, numerics_with):
    from compile_engine.kernels_generated import skinny_gemm as k
    from compile_engine.kernels_generated.configs import ConfigEntry, ConfigTable, TargetConfigs
    from compile_engine.kernels_generated.tuning import KernelConfig

    def cfg(mode, block_m, split_k):
        return {"mode": mode, "block_m": block_m, "block_n": 32, "block_k": 32,
                "split_k": split_k, "num_warps": 4, "num_stages": 2}  # fmt: skip

    # The tiny Llama's qkv_proj [128, 64] and gate_up_proj [192, 64]: fused records for a lone
    # decode token by the fma path, up to 8 rows by a swapped dot, up to 16 by a split plain
    # dot (qkv only: no split in a gated launch), none above: there the norm, then cuBLAS.
    fused = {1: {"plain": cfg("fma", 1, 1), "gated": cfg("fma", 1, 1)},
             8: {"plain": cfg("swap", 16, 1), "gated": cfg("swap", 16, 1)},
             16: {"plain": cfg("dot", 16, 2)}, 32: {}}  # fmt: skip
    entries = [
        ConfigEntry(
            {"N": n, "K": 64, "M": m},
            {"kernel": "cublas"},
            {"fused": {kind: {"config": c} for kind, c in records.items()}} if records else {},
        )
        for n in (128, 192)
        for m, records in fused.items()
    ]
    table = ConfigTable("skinny_gemm", ("N", "K", "M"), {"kernel": "cublas"},
                        {"h100": TargetConfigs(True, entries)})  # fmt: skip
    table_path = table.save(tmp_path / "skinny_gemm.json")
    kernel = KernelConfig(tables={"skinny_gemm": str(table_path)})
    modes = []
    real = k.add_rms_norm_gemm
    monkeypatch.setattr(
        k, "add_rms_norm_gemm", lambda *a, **kw: modes.append(kw["mode"]) or real(*a, **kw)
    )

    directory = make_model_dir("llama", tmp_path / "model")
    result = numerics_with(kernel, "add_rms_norm_into_gemm", directory)
    assert result["matches"] == MATCHES
    assert result["max_relative_error"] <= 2e-3  # finite, too
    assert set(modes) == {"swap", "fma", "dot"}, sorted(set(modes))
