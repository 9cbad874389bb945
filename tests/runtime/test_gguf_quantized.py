"""A quantized GGUF file through the compiled CPU engine (issue 29): it runs kept quantized by
default (our VNNI kernel, or ATen's int4 GEMM, in the graph; the Q8_0 lm_head apart), its
greedy tokens are what the eager references predict teacher-forced, the build records the
quantization, and `dtype="float32"` keeps the dequantized path. One tiny compiled engine (~20 s
on 2 cores)."""

from __future__ import annotations

import pytest
import torch
from gguf_models import tiny_llama_weights, write_quantized_gguf

from compile_engine import LLM, SamplingParams
from compile_engine.benchmarks.quant_accuracy import logits_over
from compile_engine.models.loader import dequantized_dtype, load_model
from compile_engine.models.quant import (
    QuantEmbedding,
    QuantLinear,
    quantized_layers,
    vnni_cpu_supported,
)

pytestmark = pytest.mark.skipif(
    dequantized_dtype(torch.device("cpu")) != torch.bfloat16 and not vnni_cpu_supported(),
    reason="GGUF stays quantized only where the CPU has VNNI or multiplies bfloat16",
)


@pytest.fixture(scope="module")
def q4_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf-q4") / "tiny-q4_1.gguf"
    return write_quantized_gguf(path, tiny_llama_weights(seed=5), "Q4_1")


@pytest.mark.slow
def test_compiled_engine_runs_kept_quantized_and_matches_the_references(q4_file) -> None:
    # The pieces only: the CPU decode graph over the kept-quantized weights compiles in the
    # README main job's test (test_engine_equivalence), on the real SmolLM2.
    llm = LLM(
        str(q4_file), target="cpu", max_model_len=128, max_num_seqs=4,
        passes="-paged_attention_cpu",
    )  # fmt: skip
    loaded = llm.engine.loaded
    # float32 around the integer GEMMs: our VNNI kernel's where the CPU has it, else ATen's
    # int4 GEMM, which computes in bfloat16 (models/quant.py)
    assert loaded.dtype == torch.float32 and loaded.quant.method == "gguf"
    expected = (
        "uint4:group32:int16_group:vnni_cpu"
        if vnni_cpu_supported()
        else "uint4:group32:none:int4pack_cpu"
    )
    assert str(loaded.quant.scheme) == expected
    assert isinstance(loaded.model.model.embed_tokens, QuantEmbedding)
    record = quantized_layers(loaded.model, loaded.quant)
    assert record["embedding"] == "int8:group32:none" and len(record["layers"]) == 9
    prompts = [[1, 7, 30, 12, 5], [1, 44, 3]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts, params)
    reference = load_model(str(q4_file))  # dtype auto  # eager: every op its reference
    assert isinstance(reference.model.model.layers[0].mlp.down_proj, QuantLinear)
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = list(out.outputs[0].token_ids)
        ids = torch.tensor(prompt + tokens)
        logits = logits_over(reference, ids)[len(prompt) - 1 : -1]  # [10, V]
        top2 = logits.topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) > 0.05  # bfloat16 ties may go either way
        agree = logits.argmax(-1) == torch.tensor(tokens)
        assert agree[decided].all(), (tokens, logits.argmax(-1).tolist())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_explicit_dtype_keeps_the_dequantized_path(q4_file, dtype: str) -> None:
    loaded = load_model(str(q4_file), dtype=dtype)
    assert loaded.quant is None and loaded.dtype == getattr(torch, dtype)
    assert not any(isinstance(m, (QuantLinear, QuantEmbedding)) for m in loaded.model.modules())
