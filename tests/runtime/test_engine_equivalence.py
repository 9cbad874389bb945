"""Engine greedy tokens equal HF greedy tokens (float32, CPU): a batch of mixed-length
prompts under default settings, chunked prefill (budget 16), preemption, prefix caching and
n=2, for every tiny architecture and for the real SmolLM2."""

from __future__ import annotations

import pytest
import torch

from compile_engine import LLM, SamplingParams

from oracle import GREEDY, NEW_TOKENS, hf_greedy, mixed_prompts
from tiny_models import TINY_ARCHS, make_tiny_model

SCENARIOS = {
    "default": dict(),
    "chunked-budget-16": dict(max_num_batched_tokens=16),
    "preemption": dict(block_size=4, num_kv_blocks=22, max_num_batched_tokens=64),
}


@pytest.fixture(scope="module", params=sorted(TINY_ARCHS))
def tiny(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = make_tiny_model(request.param, directory)
    return directory, hf_model


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_greedy_equals_hf(tiny, scenario):
    directory, hf_model = tiny
    llm = LLM(
        str(directory), dtype="float32", target="cpu", enforce_eager=True, **SCENARIOS[scenario]
    )
    prompts = mixed_prompts(hf_model.config.vocab_size, seed=1)
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS), (
            f"prompt of {len(prompt)} tokens diverges from HF under {scenario}"
        )
        assert out.outputs[0].finish_reason == "length"
    stats = llm.engine.stats()
    if scenario == "preemption":
        assert stats.num_preemptions_total > 0, "the small pool should have forced preemption"
    assert stats.num_running == stats.num_waiting == 0
    assert stats.kv_cache_usage == 0.0
    llm.engine.scheduler.check_integrity()


def test_prefix_cache_hits_keep_greedy_exact(tiny):
    directory, hf_model = tiny
    llm = LLM(str(directory), dtype="float32", target="cpu", block_size=4, enforce_eager=True)
    prompts = mixed_prompts(hf_model.config.vocab_size, seed=2, shared_prefix=13)
    llm.generate(prompts[:1], GREEDY)  # warms the cache with the shared prefix
    before = llm.engine.stats().prefix_cache_hits
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.stats().prefix_cache_hits - before >= 12 * (len(prompts) - 1)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS)


def test_n2_greedy_equals_n1(tiny):
    directory, hf_model = tiny
    llm = LLM(str(directory), dtype="float32", target="cpu", block_size=4, enforce_eager=True)
    prompts = mixed_prompts(hf_model.config.vocab_size, seed=3)
    n1 = llm.generate(prompts, GREEDY)
    n2_params = SamplingParams(n=2, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    n2 = llm.generate(prompts, n2_params)
    for a, b in zip(n1, n2, strict=True):
        assert len(b.outputs) == 2
        assert b.outputs[0].token_ids == b.outputs[1].token_ids == a.outputs[0].token_ids


SMOLLM2_SCENARIOS = {
    **SCENARIOS,
    # Chat prompts share the template's default system line: later ones hit its blocks.
    "prefix-cache": dict(block_size=4, max_num_seqs=2),
    "n2": dict(),
}


@pytest.fixture(scope="module")
def smollm2_cases(smollm2_hf, smollm2_tokenizer):
    """Six chat prompts of mixed lengths with HF's greedy continuations, computed once."""
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "2+2=?",
        "Name three primary colors and explain why they are called primary.",
        "Hi",
        "Translate 'good morning' into Spanish.",
    ]
    prompts = []
    for q in questions:
        ids = smollm2_tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return prompts, [hf_greedy(smollm2_hf, p, NEW_TOKENS) for p in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", sorted(SMOLLM2_SCENARIOS))
def test_smollm2_greedy_equals_hf(smollm2_cases, scenario):
    prompts, want = smollm2_cases
    settings = SMOLLM2_SCENARIOS[scenario]
    llm = LLM("smollm2-135m", dtype="float32", target="cpu", enforce_eager=True, **settings)
    params = GREEDY
    if scenario == "n2":
        params = SamplingParams(n=2, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for out, expected in zip(outs, want, strict=True):
        assert all(o.token_ids == expected for o in out.outputs), scenario
    stats = llm.engine.stats()
    if scenario == "preemption":
        assert stats.num_preemptions_total > 0
    if scenario == "prefix-cache":
        assert stats.prefix_cache_hits > 0
    assert stats.kv_cache_usage == 0.0


@pytest.mark.slow
def test_smollm2_chat_names_paris(smollm2_llm):
    out = smollm2_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=32),
    )
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"


@pytest.mark.slow
def test_prompt_with_a_lone_surrogate_is_refused_and_queues_nothing(smollm2_llm):
    engine = smollm2_llm.engine
    with pytest.raises(ValueError, match=r"not valid Unicode .*index 3"):
        engine.add_request("lone", "Hi \ud800 there", SamplingParams(max_tokens=1))
    assert not engine.has_unfinished_requests()
    out = smollm2_llm.generate(["Hi \U0001f600"], SamplingParams(max_tokens=1))  # a real pair
    assert len(out[0].outputs[0].token_ids) == 1


@pytest.mark.slow
def test_smollm2_defaults_compile_quantized_and_name_paris():
    """The README's main job: every default (GGUF "auto" dtype, compiled, prefix caching). On a
    CPU with AVX-512 VNNI or AVX2 (our kernel), or bfloat16 (ATen's int4 GEMM), the file stays
    4-bit, float32 around the integer GEMMs (models/loader.py)."""
    from compile_engine.models.loader import dequantized_dtype
    from compile_engine.models.quant import vnni_cpu_supported

    llm = LLM("smollm2-135m", target="cpu", num_kv_blocks=256)
    vnni = vnni_cpu_supported()
    quantized = vnni or dequantized_dtype(torch.device("cpu")) == torch.bfloat16
    assert llm.engine.loaded.dtype == torch.float32
    assert (llm.engine.loaded.quant is not None) == quantized
    if vnni:
        assert llm.engine.loaded.quant.scheme.layout == "vnni_cpu"
    assert llm.engine.compiled.decode_backend.stats.outlined == 29  # layers 1..29 one subgraph
    assert llm.engine.compiled is not None and llm.engine.compiled.recompilations == 0
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=32),
    )
    assert "Paris" in out[0].outputs[0].text
