"""On the H200 (skipped without CUDA): EAGLE-3 and MTP heads beside a compiled target with
CUDA graphs. Tiny float32 models: greedy tokens equal the same engine's without speculation,
every target step replays a captured graph (the graph's output carries the aux hidden states),
and heads that agree with their target have every draft accepted. The Llama-3-8B shape (4
layers, bf16, written by `bench make-model`, head `llama3-8b-eagle3`): the published head
loads, drafts, and one draft step at batch 1 is timed (printed; bench latency records it as
spec_draft_step_ms_bs1)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SETTINGS = dict(target="h100", dtype="float32", num_kv_blocks=256, max_num_seqs=16)


def _run(target, spec, prompts, params):
    from compile_engine import LLM

    llm = LLM(str(target), speculative_config=spec, **SETTINGS)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    stats, counters = llm.engine.stats(), llm.engine.runner.counters
    assert stats.spec_num_drafts > 0, spec
    assert counters.graph_steps == counters.steps, (counters, spec)
    step_ms = 1e3 * llm.engine.runner.speculator.proposer.draft_step_seconds()
    del llm
    torch.cuda.empty_cache()
    return got, stats, step_ms


def test_eagle3_and_mtp_greedy_equal_plain_with_cuda_graphs(tmp_path):
    from compile_engine import LLM, SamplingParams

    from oracle import mixed_prompts
    from tiny_deepseek import make_tiny_deepseek
    from tiny_heads import make_constant_target, make_tiny_eagle3
    from tiny_models import make_tiny_model

    prompts = mixed_prompts(96, seed=1) + [[5, 6, 7, 8] * 6]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    always = dict(min_acceptance_rate=0.0, adaptive=False)
    llama, ds = tmp_path / "llama", tmp_path / "ds"
    make_tiny_model("llama", llama)
    make_tiny_deepseek("deepseek-v3", ds, mtp=True)
    head = make_tiny_eagle3(llama, tmp_path / "head", aux_layer_ids=[0, 1, 2])
    cases = [
        (llama, dict(method="eagle3", model=str(head), num_speculative_tokens=3, **always)),
        (ds, dict(method="mtp", num_speculative_tokens=2, **always)),
    ]
    for target, spec in cases:
        plain = LLM(str(target), **SETTINGS)
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
        del plain
        got, _, _ = _run(target, spec, prompts, params)
        assert got == want, spec
    # Agreeing heads: every draft accepted.
    const = tmp_path / "const"
    model = make_constant_target(make_tiny_model, "llama", const)
    del model
    head = make_tiny_eagle3(const, tmp_path / "const-head", constant=True)
    spec = dict(method="eagle3", model=str(head), num_speculative_tokens=4, **always)
    got, stats, _ = _run(const, spec, prompts, params)
    assert all(t == [0] * 24 for t in got)
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0


def test_the_published_eagle3_head_shape_loads_and_drafts_at_llama3_8b_width(tmp_path):
    from compile_engine import LLM, SamplingParams
    from compile_engine.benchmarks.make_model import make_eagle3_head, make_model

    target = make_model("llama3-8b", tmp_path / "target", device="cuda", layers=4)
    head = make_eagle3_head("llama3-8b", tmp_path / "head", device="cuda")
    spec = dict(
        method="eagle3",
        model=str(head),
        num_speculative_tokens=3,
        min_acceptance_rate=0,
        adaptive=False,
    )
    llm = LLM(str(target), target="h100", dtype="bfloat16", max_num_seqs=8, speculative_config=spec)
    proposer = llm.engine.runner.speculator.proposer
    assert proposer.head.lm_head.weight.shape == (32000, 4096)
    assert proposer.head.fc.weight.shape == (4096, 3 * 4096)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    out = llm.generate([[1, 2, 3, 4, 5] * 8], params)
    assert len(out[0].outputs[0].token_ids) == 32
    assert llm.engine.stats().spec_num_drafts > 0
    step_ms = 1e3 * proposer.draft_step_seconds()
    print(f"EAGLE-3 draft step at batch 1, Llama-3-8B width: {step_ms:.3f} ms")
    assert step_ms < 50
