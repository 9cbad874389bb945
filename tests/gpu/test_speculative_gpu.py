"""On the H200 (skipped without CUDA): speculative decoding through the CUDA path. A compiled
engine with CUDA graphs verifies 1 + k tokens a row, mid-size steps that replay the captured
graphs padded to a captured size; its greedy tokens equal the same engine's without
speculation, with n-gram drafts and with a compiled draft model (the target itself, so every
draft is accepted, and a model of another seed, so most are rejected), in float32; and on the
real SmolLM2 in bfloat16 at batch 1, where only the one-token rows of a verification step (the
paged-attention kernel writing first) and one GEMM config for 1-16 rows keep the argmax's
near-ties where plain decode puts them."""

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


def test_greedy_ngram_on_smollm2_in_bf16_equals_plain_decode():
    """Issue 33's lossless target on the GPU: SmolLM2 in bfloat16, the shipped speculative
    workload's prompts one at a time, n-gram drafts at k = 6: every token equals plain
    decode's. Before the one-token verification rows and the shared GEMM configs, 5-7 of the
    14 prompts' outputs differed at near-tied argmaxes (aa5fafa); 1 of these 8 until the norm
    took its one-row config at <= 16 rows (f257d1c; passed on the H200 at 997e30e)."""
    from compile_engine import LLM, SamplingParams
    from compile_engine.benchmarks.speculative import chat_token_ids, load_workload

    from oracle_trained import smollm2_gguf

    path = str(smollm2_gguf())
    settings = dict(target="h100", max_model_len=2048, max_num_seqs=4, num_kv_blocks=512)
    params = SamplingParams(temperature=0, max_tokens=96)
    plain = LLM(path, **settings)
    prompts = [chat_token_ids(plain.engine.tokenizer, it["messages"]) for it in load_workload()]
    want = [plain.generate([p], params)[0].outputs[0].token_ids for p in prompts[:8]]
    del plain
    spec = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 2,
            "prompt_lookup_max": 4, "adaptive": False, "min_acceptance_rate": 0.0}  # fmt: skip
    llm = LLM(path, speculative_config=spec, **settings)
    got = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts[:8]]
    differ = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
    assert not differ, f"prompts {differ} of 8 differ from plain decode"
    assert llm.engine.stats().spec_num_accepted_tokens > 100
    counters = llm.engine.runner.counters
    assert counters.graph_steps == counters.steps
