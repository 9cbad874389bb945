"""On the H200 (skipped without CUDA): speculative decoding through the CUDA path. A compiled
engine with CUDA graphs verifies 1 + k tokens a row, mid-size steps that replay the captured
graphs padded to a captured size; its greedy tokens equal the same engine's without
speculation, with n-gram drafts and with a compiled draft model (the target itself, so every
draft is accepted, and a model of another seed, so most are rejected). Float32, so that the
different row counts of decode and verification GEMMs cannot flip an argmax."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_greedy_speculative_equals_plain_with_cuda_graphs(tmp_path):
    from compile_engine import LLM, SamplingParams

    from oracle import mixed_prompts
    from tiny_models import make_tiny_model

    target, other = tmp_path / "target", tmp_path / "other"
    make_tiny_model("llama", target)
    make_tiny_model("llama", other, seed=7)
    settings = dict(target="h100", dtype="float32", num_kv_blocks=256, max_num_seqs=16)
    prompts = mixed_prompts(96, seed=1) + [[5, 6, 7, 8] * 6, [9, 10, 11] * 5]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(target), **settings)
    assert plain.engine.runner.graphs is not None, "no CUDA graphs were captured"
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    specs = [
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "min_acceptance_rate": 0.0},
        # The draft models at a fixed k (an eager-run draft may not pay, so the per-step
        # choice could leave it idle); n-gram above chooses k per step.
        {"method": "draft_model", "model": str(target), "num_speculative_tokens": 4,
         "adaptive": False},
        {"method": "draft_model", "model": str(other), "num_speculative_tokens": 3,
         "min_acceptance_rate": 0.0, "adaptive": False},
    ]  # fmt: skip
    for spec in specs:
        llm = LLM(str(target), speculative_config=spec, **settings)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == want, spec
        stats, counters = llm.engine.stats(), llm.engine.runner.counters
        assert stats.spec_num_drafts > 0, spec
        # Every step, verification steps included, replayed a captured graph.
        assert counters.graph_steps == counters.steps, (counters, spec)
        del llm
        torch.cuda.empty_cache()
