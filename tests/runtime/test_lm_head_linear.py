"""The runner's lm_head hook (ModelRunner.lm_head_linear, set by the engine under
COMPILE_ENGINE_LM_HEAD_SKINNY=1 on h100): the sampled rows' logits go through the given linear
with the model's lm_head weight (the embedding where tied), and greedy output stays HF's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import GREEDY, NEW_TOKENS, hf_greedy, mixed_prompts
from tiny_models import make_tiny_model

from runtime import LLM


@pytest.mark.parametrize("arch", ["llama", "llama-mha-tied"])
def test_logits_through_the_hook_keep_greedy_exact(tmp_path, arch):
    hf_model = make_tiny_model(arch, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", target="cpu", enforce_eager=True)
    runner = llm.engine.runner
    assert runner.lm_head_linear is None  # not on the CPU target, nor without the switch
    calls = []

    def linear(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        calls.append((hidden.shape[0], weight))
        return F.linear(hidden, weight)

    runner.lm_head_linear = linear
    prompts = mixed_prompts(hf_model.config.vocab_size, seed=1)
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS)
    want = hf_model.get_output_embeddings().weight
    assert calls and all(torch.equal(w, want) for _, w in calls)
    assert max(rows for rows, _ in calls) == len(prompts)  # every running request's row
