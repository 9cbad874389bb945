"""Our forward through the paged cache equals HF transformers (float32, CPU) for every
supported architecture: packed sequences, prefill chunks then decode steps, several block
sizes (1, 16, and 5, which is not a power of two)."""

from __future__ import annotations

import random

import pytest
import torch

from compile_engine.models.loader import load_model

from paged_harness import PagedHarness, first_divergent_layer, run_schedule
from tiny_models import TINY_ARCHS, make_tiny_model

RTOL = 1e-4


@pytest.fixture(scope="module", params=sorted(TINY_ARCHS))
def tiny(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = make_tiny_model(request.param, directory)
    return request.param, hf_model, load_model(directory, dtype="float32")


def _hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_packed_chunked_prefill_and_decode_match_hf(tiny, block_size):
    name, hf_model, loaded = tiny
    rng = random.Random(block_size)
    vocab = loaded.config.vocab_size
    lengths = [1, 7, 19, 33, 12]
    sequences = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    harness = PagedHarness(loaded.model, block_size, num_blocks=200 // block_size + 64)
    ours = run_schedule(harness, sequences, prefill_chunk=6, decode_tail=4)
    for tokens, got in zip(sequences, ours, strict=True):
        want = _hf_logits(hf_model, tokens)
        err = ((got - want).abs().max() / want.abs().max()).item()
        if err > RTOL:
            where = first_divergent_layer(hf_model, loaded.model, tokens)
            pytest.fail(f"{name}: logits differ from HF by {err:.2e} (> {RTOL}); first at {where}")


def test_config_matches_hf(tiny):
    name, hf_model, loaded = tiny
    cfg, hf = loaded.config, hf_model.config
    assert cfg.num_layers == hf.num_hidden_layers
    assert cfg.num_kv_heads == hf.num_key_value_heads
    assert cfg.tie_word_embeddings == bool(hf.tie_word_embeddings)
    if cfg.tie_word_embeddings:
        assert loaded.model.lm_head is None


def test_under_torch_compile_matches_eager(tmp_path):
    """The ops trace as single nodes with their fake implementations (dynamic token count,
    the KV write functionalised) and compute what eager computes."""
    hf_model = make_tiny_model("qwen3", tmp_path)
    loaded = load_model(tmp_path, dtype="float32")
    tokens = [[3, 5, 7, 11, 13, 17, 19], [23, 29, 31]]
    eager = run_schedule(PagedHarness(loaded.model, 4, 32), tokens, 3, 2)
    torch._dynamo.reset()
    compiled = torch.compile(loaded.model, backend="aot_eager", dynamic=True, fullgraph=True)
    compiled.config = loaded.model.config
    compiled.compute_logits = loaded.model.compute_logits
    got = run_schedule(PagedHarness(compiled, 4, 32), tokens, 3, 2)
    for a, b in zip(eager, got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert hf_model is not None
