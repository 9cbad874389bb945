"""skinny_gemm: every bias-free linear on h100 in half precision, none elsewhere; numerics
with it off, with the Triton kernel really running (a table tuned for the tiny model's
weights, every inner product and a split-K among its entries).

The numerics case runs the Triton kernel, which on CPU needs TRITON_INTERPRET=1 from the start
of the process: it runs in the child that tests/kernels/test_skinny_gemm.py starts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compile_engine.passes.base import PassContext
from compile_engine.passes.registry import select

from pass_kit import (
    apply_pass,
    capture_graph,
    count_matches,
    make_model_dir,
    targets_of,
)

LAYERS = 2  # tests/tiny_models
LINEARS = 4  # qkv_proj, o_proj, gate_up_proj, down_proj


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_linear_on_h100(graph, dtype):
    ctx = PassContext("h100", dtype)
    assert count_matches("skinny_gemm", graph, ctx) == LINEARS * LAYERS
    gm = apply_pass("skinny_gemm", graph, ctx)
    targets = targets_of(gm)
    assert F.linear not in targets
    kernel = torch.ops.ce_kernels.skinny_linear.default
    assert targets.count(kernel) == LINEARS * LAYERS
    # (x, w, the kernel config's key): the table the op dispatches by is the context's.
    calls = [n for n in gm.graph.nodes if n.target is kernel]
    assert all(len(n.args) == 3 and n.args[2] == ctx.kernel.key for n in calls)


def test_linear_with_bias_left_to_inductor():
    # Qwen2's qkv_proj has a bias: only o_proj, gate_up_proj and down_proj are taken.
    gm = capture_graph("qwen2")
    ctx = PassContext("h100", torch.bfloat16)
    assert count_matches("skinny_gemm", gm, ctx) == (LINEARS - 1) * LAYERS
    assert targets_of(apply_pass("skinny_gemm", gm, ctx)).count(F.linear) == LAYERS


@pytest.mark.parametrize(
    "ctx", [PassContext("cpu", torch.float32), PassContext("h100", torch.float32)]
)
def test_does_not_apply_on_cpu_or_in_float32(graph, ctx):
    assert count_matches("skinny_gemm", graph, ctx) == 0


def test_on_by_default_and_removable():
    # On: x1.05-1.20 over cuBLAS where its table picks Triton, cuBLAS itself elsewhere.
    chosen = [p.name for p in select(None)]
    assert chosen.index("skinny_gemm") < chosen.index("lower_to_reference")
    assert "skinny_gemm" not in [p.name for p in select("-skinny_gemm")]


@pytest.mark.interpreted_child("TRITON_INTERPRET")
def test_interpreted_numerics_unchanged(tmp_path, monkeypatch, numerics_with):
    from compile_engine.kernels_generated import skinny_gemm as k
    from compile_engine.kernels_generated.configs import ConfigEntry, ConfigTable, TargetConfigs
    from compile_engine.kernels_generated.tuning import KernelConfig

    def cfg(mode, block_m, split_k):
        return {"kernel": "triton", "mode": mode, "block_m": block_m, "block_n": 32,
                "block_k": 32, "split_k": split_k, "num_warps": 4, "num_stages": 2}  # fmt: skip

    # Per weight of the tiny Llama: a lone decode token (rows 1) by the fma path, up to 8 rows
    # by a split swapped dot, up to 16 by a split plain dot, more by cuBLAS; down_proj's K = 96
    # splits with a masked tail.
    per_bucket = {1: cfg("fma", 1, 1), 8: cfg("swap", 16, 2), 16: cfg("dot", 16, 3),
                  32: {"kernel": "cublas"}}  # fmt: skip
    weights = ((128, 64), (64, 64), (192, 64), (64, 96))
    entries = [
        ConfigEntry({"N": n, "K": kk, "M": m}, c)
        for n, kk in weights
        for m, c in per_bucket.items()
    ]
    table = ConfigTable("skinny_gemm", ("N", "K", "M"), {"kernel": "cublas"},
                        {"h100": TargetConfigs(True, entries)})  # fmt: skip
    table_path = table.save(tmp_path / "skinny_gemm.json")
    kernel = KernelConfig(tables={"skinny_gemm": str(table_path)})
    modes = []
    real = k.skinny_gemm
    monkeypatch.setattr(
        k, "skinny_gemm", lambda *a, **kw: modes.append(kw["mode"]) or real(*a, **kw)
    )

    directory = make_model_dir("llama", tmp_path / "model")
    result = numerics_with(kernel, "skinny_gemm", directory)
    assert result["matches"] == LINEARS * LAYERS
    assert result["max_relative_error"] <= 2e-3  # finite, too
    assert set(modes) == {"swap", "fma", "dot"}, sorted(set(modes))
