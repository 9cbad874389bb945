"""A compiled tensor-parallel engine: 2 gloo processes each capture and compile their shard
(Inductor), the functional all-reduces stay in the graph through Dynamo, the passes and
Inductor, and the greedy tokens equal HF's. The one compiled case (tens of seconds cold on
CI's 2 cores, a few warm from the suite's Inductor cache); the equivalence of every
architecture is checked eagerly in test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch

from compile_engine import LLM, SamplingParams
from compile_engine.runtime import parallel

from oracle import hf_greedy
from tiny_models import make_tiny_model

LAYERS = 2  # tests/tiny_models


@pytest.mark.slow
def test_compiled_shards_equal_hf(tmp_path):
    hf_model = make_tiny_model("llama", tmp_path)
    prompts = [[5], [7, 11, 13, 17, 19, 23, 29, 31, 37]]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    try:
        llm = LLM(
            str(tmp_path), dtype="float32", target="cpu", num_kv_blocks=64, tensor_parallel_size=2
        )
        compiled = llm.engine.compiled
        # o_proj's and down_proj's all-reduce of each layer fused with the norm after it.
        assert compiled.pass_manager.match_counts["all_reduce_norm"] == 2 * LAYERS
        assert compiled.recompilations == 0
        outs = llm.generate(prompts, params)
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 5)
        assert compiled.recompilations == 0
    finally:
        parallel.shutdown_active()
    assert not torch.distributed.is_initialized()
