"""The backend runs each distinct piece once on fake tensors and reuses its outputs' metadata
for every identical piece after it (same graph, same input metadata). Oracle: running every
piece again, as before, gives outputs of the same shapes, strides and dtypes, and the compiled
model still generates HF's tokens."""

from __future__ import annotations

import pytest
import torch
import transformers

from compile_engine import LLM
from compile_engine.compiler import backend

from oracle import GREEDY, NEW_TOKENS, hf_greedy

pytestmark = pytest.mark.slow


def _metadata(value) -> list:
    flat, _ = torch.utils._pytree.tree_flatten(value)
    return [
        (tuple(t.shape), t.stride(), t.dtype) if isinstance(t, torch.Tensor) else repr(t)
        for t in flat
    ]


def test_reused_piece_outputs_match_a_fresh_run(tmp_path, monkeypatch):
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,  # layers 1..3 give identical pieces
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.15,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(config).eval()
    hf_model.save_pretrained(tmp_path)

    checked = {"pieces": 0, "reused": 0}
    original = backend._PieceCompiler.call_module

    def checking_call_module(self, target, args, kwargs):
        before = len(self.outputs_seen)
        piece = self.fetch_attr(target)  # the graph: the call swaps in the compiled piece
        out = original(self, target, args, kwargs)
        fresh = piece(*args, **kwargs)
        assert _metadata(out) == _metadata(fresh), target
        checked["pieces"] += 1
        checked["reused"] += len(self.outputs_seen) == before
        return out

    monkeypatch.setattr(backend._PieceCompiler, "call_module", checking_call_module)
    # The split graph only: the CPU decode step's graph is one piece, reused by nothing, and
    # its compile would double this test's on CI's 2 cores.
    llm = LLM(
        str(tmp_path), dtype="float32", target="cpu", num_kv_blocks=16,
        passes="-paged_attention_cpu",
    )  # fmt: skip
    # 4 attention pieces and 5 others, all but the first attention piece and 3 others reused.
    assert checked == {"pieces": 9, "reused": 5}
    prompt = [5, 9, 11, 3]
    got = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert got == hf_greedy(hf_model, prompt, NEW_TOKENS)
