"""The residual adds of the compiled forward cost no copy (compiler/inductor_passes.py).

Inductor fuses `o_proj(x) + residual` and `down_proj(x) + residual` into aten.addmm with the
residual as a 2-D `self`, which aten copies into the output before the GEMM: 62 device
memcpys of [T, 4096] per Llama-3-8B step on the H200. On CPU Inductor fuses every such add
(its `should_prefer_unfused_addmm` is GPU-only), so the CPU build shows the copies too, as
aten::copy_ under aten::addmm, and is where this test catches them coming back.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from compile_engine.compiler.compiled_model import CompiledForward
from compile_engine.compiler.config import CompileConfig
from compile_engine.compiler.inductor_passes import UNFUSE_RESIDUAL_ADDMM, UnfuseResidualAddmm
from compile_engine.models.loader import load_model

from paged_harness import PagedHarness, run_schedule
from tiny_models import make_tiny_model

aten = torch.ops.aten


def _addmm_targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_pass_unfuses_a_residual_addmm_and_keeps_a_bias_addmm():
    def f(residual, bias, x, w):
        return aten.addmm(residual, x, w), aten.addmm(bias, x, w)

    gen = torch.Generator().manual_seed(0)
    residual, x = torch.randn(5, 8, generator=gen), torch.randn(5, 3, generator=gen)
    bias, w = torch.randn(8, generator=gen), torch.randn(3, 8, generator=gen)
    gm = make_fx(f, tracing_mode="fake")(residual, bias, x, w)
    unfuse = UnfuseResidualAddmm()
    unfuse(gm.graph)
    gm.recompile()
    assert unfuse.rewritten == 1
    targets = _addmm_targets(gm)
    assert targets.count(aten.addmm.default) == 1  # the bias one, a cuBLASLt epilogue
    assert targets.count(aten.mm.default) == 1 and targets.count(aten.add.Tensor) == 1
    summed, biased = gm(residual, bias, x, w)
    assert torch.equal(summed, x @ w + residual)  # rounded as written: mm, then the add
    assert torch.equal(biased, torch.addmm(bias, x, w))


@pytest.mark.slow
def test_compiled_llama_forward_makes_no_residual_copies(tmp_path):
    make_tiny_model("llama", tmp_path / "model")
    loaded = load_model(tmp_path / "model", dtype=torch.float32)
    model, hidden = loaded.model, loaded.config.hidden_size
    # A cache of its own: a hit would skip Inductor's post-grad passes, and ours with them.
    config = CompileConfig(target="cpu", cache_dir=tmp_path / "inductor")
    compiled = CompiledForward(model, config, torch.float32)
    harness = PagedHarness(model, block_size=4, num_blocks=64, forward=compiled)
    before = UNFUSE_RESIDUAL_ADDMM.rewritten
    compiled.capture(harness.kv_caches)
    rewritten = UNFUSE_RESIDUAL_ADDMM.rewritten - before

    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (13, 6, 21)]
    got = run_schedule(harness, sequences, prefill_chunk=5, decode_tail=3)
    eager = run_schedule(PagedHarness(model, block_size=4, num_blocks=64), sequences, 5, 3)
    for a, b in zip(got, eager, strict=True):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()

    step = [(9, list(range(3, 14))), (10, [4, 5])]  # 13 new tokens: a prefill and a chunk
    num_tokens = sum(len(t) for _, t in step)
    with torch.profiler.profile(record_shapes=True) as prof:
        harness.step(step)
    copies = [
        (e.name, e.input_shapes)
        for e in prof.events()
        if e.name == "aten::addmm"
        or (
            e.name in ("aten::copy_", "aten::clone")
            and e.input_shapes
            and e.input_shapes[0] == [num_tokens, hidden]
        )
    ]
    assert copies == [], f"residual copies are back in the compiled forward: {copies}"
    assert compiled.recompilations == 0
    # 2 layers: the middle piece and the last each hold both residual adds of a layer, and the
    # CPU decode graph (one piece) all four again. 0 with no copy above would mean Inductor
    # stopped fusing them: the pass may then be obsolete.
    assert rewritten == 8, f"the pass unfused {rewritten} addmm nodes, expected 8"
