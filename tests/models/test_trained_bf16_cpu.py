"""The compiled CPU path in bf16 against HF bf16 on trained weights (SmolLM2-135M): the same
teacher-forced comparison and bar as the H200 test (tests/gpu/test_trained_bf16.py), here
with transformers' own GGUF load as the oracle."""

from __future__ import annotations

import pytest

from compile_engine import LLM

from oracle_trained import (
    check,
    compare,
    engine_teacher_forced,
    hf_bf16_copy,
    hf_teacher_forced,
    trained_sequences,
)


@pytest.mark.slow
def test_compiled_cpu_bf16_agrees_with_hf_bf16_on_smollm2(smollm2_hf):
    # The pieces only, not the CPU decode graph (passes/paged_attention_cpu.py off): the decode
    # graph's Inductor compile of all 30 layers is ~40 s of this test's ~100 on CI's 2 cores,
    # and it compiles in float32 in the README's main-job test (test_engine_equivalence).
    llm = LLM(
        "smollm2-135m",
        target="cpu",
        dtype="bfloat16",
        num_kv_blocks=256,
        passes="-paged_attention_cpu",
    )
    assert llm.engine.compiled is not None and llm.engine.compiled.decode_backend is None
    sequences = trained_sequences(llm.tokenizer)
    ours = engine_teacher_forced(llm, sequences, prefill_chunk=128, decode_tail=32)
    hf_bf16 = hf_bf16_copy(smollm2_hf)
    result = compare(
        ours, hf_teacher_forced(hf_bf16, sequences), hf_teacher_forced(smollm2_hf, sequences)
    )
    print(f"\nCPU SmolLM2 compiled bf16 vs HF: {result}")
    check(result)
