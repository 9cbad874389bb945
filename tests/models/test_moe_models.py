"""Mixtral, Qwen2-MoE and Qwen3-MoE through our loader and paged forward equal HF transformers
(float32, CPU): logits of packed chunked prefill + decode within 1e-4, and greedy tokens
identical. Both checkpoint layouts transformers 5.17 writes are loaded: the classic per-expert
names (save_pretrained's default) and the stacked ones (save_original_format=False)."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from compile_engine.models.errors import CheckpointError, UnsupportedModelError
from compile_engine.models.loader import load_model
from compile_engine.models.moe import MoEConfig, SparseMoE, sparse_layer_indices

from oracle import hf_greedy
from paged_harness import PagedHarness, first_divergent_layer, run_schedule
from tiny_moe import _COMMON, MOE_ARCHS, make_tiny_moe

RTOL = 1e-4


@pytest.fixture(scope="module", params=sorted(MOE_ARCHS))
def tiny(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = make_tiny_moe(request.param, directory)
    return request.param, hf_model, load_model(directory, dtype="float32")


def _assert_logits_match(name, hf_model, model, sequences, ours):
    for tokens, got in zip(sequences, ours, strict=True):
        with torch.no_grad():
            want = hf_model(torch.tensor([tokens])).logits[0]
        err = ((got - want).abs().max() / want.abs().max()).item()
        if err > RTOL:
            where = first_divergent_layer(hf_model, model, tokens)
            pytest.fail(f"{name}: logits differ from HF by {err:.2e} (> {RTOL}); first at {where}")


@pytest.mark.parametrize("block_size", [1, 16])
def test_packed_chunked_prefill_and_decode_match_hf(tiny, block_size):
    name, hf_model, loaded = tiny
    rng = random.Random(block_size)
    sequences = [[rng.randrange(3, 96) for _ in range(n)] for n in (1, 7, 19, 12)]
    harness = PagedHarness(loaded.model, block_size, num_blocks=200 // block_size + 32)
    ours = run_schedule(harness, sequences, prefill_chunk=6, decode_tail=4)
    _assert_logits_match(name, hf_model, loaded.model, sequences, ours)


def test_greedy_tokens_match_hf(tiny):
    name, hf_model, loaded = tiny
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 96) for _ in range(n)] for n in (5, 11, 2)]
    new_tokens = 6
    harness = PagedHarness(loaded.model, 4, 64)
    logits = harness.step([(i, p) for i, p in enumerate(prompts)])  # one packed prefill
    ours = [[int(row[-1].argmax())] for row in logits]
    for _ in range(new_tokens - 1):  # packed decode steps
        logits = harness.step([(i, [seq[-1]]) for i, seq in enumerate(ours)])
        for seq, row in zip(ours, logits, strict=True):
            seq.append(int(row[-1].argmax()))
    for prompt, got in zip(prompts, ours, strict=True):
        assert got == hf_greedy(hf_model, prompt, new_tokens), name


def test_config_and_layers_match_hf(tiny):
    name, hf_model, loaded = tiny
    cfg, hf = loaded.config, hf_model.config
    assert isinstance(cfg, MoEConfig)
    assert cfg.num_experts == getattr(hf, "num_experts", None) or hf.num_local_experts
    assert cfg.num_experts_per_tok == hf.num_experts_per_tok
    for ours, theirs in zip(loaded.model.model.layers, hf_model.model.layers, strict=True):
        hf_sparse = hasattr(theirs.mlp, "experts")
        assert isinstance(ours.mlp, SparseMoE) == hf_sparse
        if hf_sparse:
            assert torch.equal(ours.mlp.experts.w13, theirs.mlp.experts.gate_up_proj)
            assert torch.equal(ours.mlp.experts.w2, theirs.mlp.experts.down_proj)


@pytest.mark.parametrize("name", sorted(MOE_ARCHS))
def test_stacked_checkpoint_layout_loads(name, tmp_path):
    """transformers 5 can save experts already stacked (mlp.experts.gate_up_proj, Mixtral's
    block named mlp): the same model must come out."""
    hf_model = make_tiny_moe(name, tmp_path, stacked=True, seed=3)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in f.keys())  # noqa: SIM118
    loaded = load_model(tmp_path, dtype="float32")
    sequences = [[5, 9, 13, 17, 21, 25, 29], [30, 31]]
    ours = run_schedule(PagedHarness(loaded.model, 4, 32), sequences, 3, 2)
    _assert_logits_match(name, hf_model, loaded.model, sequences, ours)


def test_missing_expert_tensor_is_named(tmp_path):
    make_tiny_moe("mixtral", tmp_path)
    from safetensors.torch import load_file, save_file

    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.block_sparse_moe.experts.4.w3.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"experts\.4\.w3\.weight"):
        load_model(tmp_path, dtype="float32")


def test_expert_beyond_config_is_an_error(tmp_path):
    make_tiny_moe("mixtral", tmp_path)
    from safetensors.torch import load_file, save_file

    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.0.block_sparse_moe.experts.6.w1.weight"] = torch.zeros(48, 64)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="expert 6"):
        load_model(tmp_path, dtype="float32")


def test_sparse_layer_rule():
    assert sparse_layer_indices(4) == (0, 1, 2, 3)
    assert sparse_layer_indices(4, step=2) == (1, 3)
    assert sparse_layer_indices(4, step=1, dense=(0, 2)) == (1, 3)


def test_unsupported_settings_are_refused(tmp_path):
    config_cls, model_cls, overrides = MOE_ARCHS["mixtral"]
    hf = getattr(transformers, config_cls)(**{**_COMMON, **overrides, "sliding_window": 64})
    hf.architectures = [model_cls]
    from compile_engine.models.registry import model_class

    with pytest.raises(UnsupportedModelError, match="sliding_window"):
        model_class([model_cls]).config_from_hf(hf)
    base = model_class([model_cls]).config_from_hf(
        getattr(transformers, config_cls)(**{**_COMMON, **overrides})
    )
    import dataclasses

    for bad, match in (
        (dict(scoring_func="relu"), "scoring_func"),
        (dict(topk_method="noaux_tc", n_group=4, topk_group=1), "divisible"),
        (dict(num_experts_per_tok=7), "num_experts_per_tok"),
    ):
        with pytest.raises(UnsupportedModelError, match=match):
            SparseMoE(dataclasses.replace(base, **bad), shards={"w13": ("a", "b"), "w2": ("c",)})


def test_under_torch_compile_matches_eager(tmp_path):
    """The MoE ops trace as single nodes with their fakes (dynamic token count, the alignment's
    capacity a symbolic expression of it) and compute what eager computes."""
    make_tiny_moe("qwen2_moe", tmp_path)
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
