"""DeepSeek-V2/V3 (MLA over a paged latent cache, DeepSeekMoE) equal HF transformers (float32,
CPU): logits of packed chunked prefill and decode through several block sizes, and greedy
tokens through the engine under chunked prefill, preemption and prefix-cache hits; MLA's
absorbed form equals the naive up-projected reference."""

from __future__ import annotations

import random

import pytest
import torch

from compile_engine import LLM
from compile_engine.benchmarks.attention_inputs import make_latent_batch
from compile_engine.models import mla
from compile_engine.models.deepseek import DeepseekConfig, softmax_scale
from compile_engine.models.loader import load_model
from compile_engine.models.moe import SparseMoE

from oracle import GREEDY, NEW_TOKENS, hf_greedy, mixed_prompts
from paged_harness import PagedHarness, first_divergent_layer, run_schedule
from tiny_deepseek import TINY_DEEPSEEK, make_tiny_deepseek

RTOL = 1e-4


@pytest.fixture(scope="module", params=sorted(TINY_DEEPSEEK))
def tiny(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = make_tiny_deepseek(request.param, directory)
    return request.param, hf_model, load_model(directory, dtype="float32"), directory


def _hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_packed_chunked_prefill_and_decode_match_hf(tiny, block_size):
    name, hf_model, loaded, _ = tiny
    rng = random.Random(block_size)
    vocab = loaded.config.vocab_size
    sequences = [[rng.randrange(vocab) for _ in range(n)] for n in (1, 7, 19, 33, 12)]
    harness = PagedHarness(loaded.model, block_size, num_blocks=200 // block_size + 64)
    ours = run_schedule(harness, sequences, prefill_chunk=6, decode_tail=4)
    for tokens, got in zip(sequences, ours, strict=True):
        want = _hf_logits(hf_model, tokens)
        err = ((got - want).abs().max() / want.abs().max()).item()
        if err > RTOL:
            where = first_divergent_layer(hf_model, loaded.model, tokens)
            pytest.fail(f"{name}: logits differ from HF by {err:.2e} (> {RTOL}); first at {where}")


def test_config_and_latent_cache(tiny):
    name, hf_model, loaded, _ = tiny
    cfg, hf = loaded.config, hf_model.config
    assert isinstance(cfg, DeepseekConfig)
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.q_lora_rank) == (
        hf.kv_lora_rank,
        hf.qk_rope_head_dim,
        hf.q_lora_rank,
    )
    # The cache holds the latent row only: R + P numbers per token slot.
    assert loaded.model.kv_cache_shape(7, 16) == (7, 16, hf.kv_lora_rank + hf.qk_rope_head_dim)
    # first_k_dense_replace dense layers, then DeepSeekMoE with shared experts.
    layers = loaded.model.model.layers
    kinds = [isinstance(layer.mlp, SparseMoE) for layer in layers]
    assert kinds == [i >= hf.first_k_dense_replace for i in range(hf.num_hidden_layers)]
    assert layers[-1].mlp.shared_experts is not None
    assert cfg.e_score_correction_bias == name.startswith("deepseek-v3")
    # HF's own softmax scale (yarn's mscale squared for the V3 config).
    assert cfg.attn_scale == pytest.approx(hf_model.model.layers[0].self_attn.scaling, rel=1e-12)


def test_yarn_mscale_sharpens_the_softmax():
    rope = {"rope_type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707}
    plain = softmax_scale(192, {"rope_type": "default"})
    assert plain == pytest.approx(192**-0.5)
    # DeepSeek-V2's own numbers: mscale(40, 0.707) = 1.2608, squared 1.5897.
    assert softmax_scale(192, rope) / plain == pytest.approx((0.1 * 0.707 * 3.6889 + 1) ** 2, 1e-4)


def test_kv_bytes_per_token_deepseek_v2_lite():
    # 27 layers, 16 heads, R 512, P 64, N 128, V 128, bf16: 576 numbers per token and layer
    # against 16 * 192 + 16 * 128 = 5120 for up-projected K and V.
    got = mla.kv_bytes_per_token(
        num_layers=27,
        num_heads=16,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        element_size=2,
    )
    assert got["latent_numbers_per_token_layer"] == 576
    assert got["naive_numbers_per_token_layer"] == 5120
    assert got["latent_bytes_per_token"] == 27 * 576 * 2
    assert got["naive_bytes_per_token"] == 27 * 5120 * 2


# --------------------------------------------------------------------------- the absorbed form


@pytest.mark.parametrize(
    "case",
    [
        ([1, 1, 1], [9, 17, 40]),  # decode
        ([5, 7], [5, 7]),  # prefill
        ([4, 1, 3], [13, 30, 3]),  # chunked prefill beside decode
        ([2, 0, 1], [2, 5, 38]),  # a sequence with no new token in between
    ],
)
def test_absorbed_form_equals_naive_reference(case):
    """W_UK absorbed into the query and W_UV applied to the latent output give the naive
    up-projected attention, and both write the same latent rows."""
    q_lens, seq_lens = case
    heads, nope, rope, rank, v_dim = 4, 16, 8, 32, 12
    batch = make_latent_batch(
        q_lens, seq_lens, num_heads=heads, kv_lora_rank=rank, rope_dim=rope, block_size=4
    )
    gen = torch.Generator().manual_seed(1)
    tokens = batch.q_latent.shape[0]
    q = torch.randn(tokens, heads, nope + rope, generator=gen)
    w_kv_b = torch.randn(heads * (nope + v_dim), rank, generator=gen) * 0.3
    meta = (batch.slot_mapping, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    cache_naive, cache_absorbed = batch.latent_cache.clone(), batch.latent_cache.clone()
    scale = (nope + rope) ** -0.5
    want = mla.mla_attention_ref(q, batch.kv_latent, cache_naive, *meta, w_kv_b, scale)
    got = mla.mla_attention_absorbed(q, batch.kv_latent, cache_absorbed, *meta, w_kv_b, scale)
    assert want.shape == (tokens, heads, v_dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache_naive, cache_absorbed)
    # The op is its reference.
    cache_op = batch.latent_cache.clone()
    op_out = mla.mla_attention(q, batch.kv_latent, cache_op, *meta, w_kv_b, scale)
    assert torch.equal(op_out, want) and torch.equal(cache_op, cache_naive)


def test_inconsistent_shapes_are_refused():
    q = torch.zeros(3, 4, 24)
    cache = torch.zeros(2, 4, 40)
    with pytest.raises(mla.MLAShapeError, match="do not describe one MLA layer"):
        mla.mla_dims(q, cache, torch.zeros(4 * 40, 48))  # rank 48 leaves no rope dims


# --------------------------------------------------------------------------- the engine

SCENARIOS = {
    "chunked-budget-16": dict(max_num_batched_tokens=16),
    "preemption": dict(block_size=4, num_kv_blocks=22, max_num_batched_tokens=64),
}
CASES = [(name, scenario) for name in sorted(TINY_DEEPSEEK) for scenario in sorted(SCENARIOS)]


@pytest.fixture(scope="module")
def hf_continuations():
    """HF's greedy continuations per (model, prompt seed), computed once per module."""
    cache: dict[tuple[str, int], list[list[int]]] = {}

    def get(name: str, hf_model, prompts: list[list[int]], seed: int) -> list[list[int]]:
        if (name, seed) not in cache:
            cache[name, seed] = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
        return cache[name, seed]

    return get


@pytest.mark.parametrize("tiny, scenario", CASES, indirect=["tiny"])
def test_engine_greedy_equals_hf(tiny, scenario, hf_continuations):
    name, hf_model, _, directory = tiny
    llm = LLM(
        str(directory), dtype="float32", target="cpu", enforce_eager=True, **SCENARIOS[scenario]
    )
    prompts = mixed_prompts(hf_model.config.vocab_size, seed=1)
    want = hf_continuations(name, hf_model, prompts, 1)
    outs = llm.generate(prompts, GREEDY)
    for prompt, out, expected in zip(prompts, outs, want, strict=True):
        assert out.outputs[0].token_ids == expected, (
            f"prompt of {len(prompt)} tokens diverges from HF under {scenario}"
        )
    stats = llm.engine.stats()
    if scenario == "preemption":
        assert stats.num_preemptions_total > 0, "the small pool should have forced preemption"
    assert stats.kv_cache_usage == 0.0
    llm.engine.scheduler.check_integrity()


@pytest.mark.parametrize("tiny", ["deepseek-v3"], indirect=True)
def test_engine_prefix_cache_hits_keep_greedy_exact(tiny):
    _, hf_model, _, directory = tiny
    llm = LLM(str(directory), dtype="float32", target="cpu", block_size=4, enforce_eager=True)
    prompts = mixed_prompts(hf_model.config.vocab_size, seed=2, shared_prefix=13)
    llm.generate(prompts[:1], GREEDY)  # warms the cache with the shared prefix
    before = llm.engine.stats().prefix_cache_hits
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.stats().prefix_cache_hits - before >= 12 * (len(prompts) - 1)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("tiny", ["deepseek-v3"], indirect=True)
def test_compiled_engine_greedy_equals_hf(tiny, hf_continuations):
    """The compiled path on CPU (default passes, mla_absorb included, Inductor pieces)."""
    name, hf_model, _, directory = tiny
    llm = LLM(str(directory), dtype="float32", target="cpu", max_num_batched_tokens=16)
    assert llm.engine.compiled.pass_manager.match_counts["mla_absorb"] == len(hf_model.model.layers)
    prompts = mixed_prompts(hf_model.config.vocab_size, seed=1)
    want = hf_continuations(name, hf_model, prompts, 1)
    outs = llm.generate(prompts, GREEDY)
    for out, expected in zip(outs, want, strict=True):
        assert out.outputs[0].token_ids == expected
    assert llm.engine.compiled.recompilations == 0


def test_v3_skips_the_multi_token_prediction_layer_and_v2_refuses_it(tmp_path):
    """Real V3 checkpoints hold the MTP module as layer N (after N decoder layers); it loads
    and is ignored, as in transformers. The same extra tensor in a V2 checkpoint is an error."""
    from safetensors.torch import load_file, save_file

    from compile_engine.models.errors import CheckpointError

    for name in ("deepseek-v3", "deepseek-v2"):
        directory = tmp_path / name
        hf_model = make_tiny_deepseek(name, directory)
        path = directory / "model.safetensors"
        tensors = load_file(path)
        extra = f"model.layers.{hf_model.config.num_hidden_layers}.eh_proj.weight"
        tensors[extra] = torch.zeros(4, 4)
        save_file(tensors, path, metadata={"format": "pt"})
        if name == "deepseek-v3":
            loaded = load_model(directory, dtype="float32")
            assert len(loaded.model.model.layers) == hf_model.config.num_hidden_layers
        else:
            with pytest.raises(CheckpointError, match="unexpected tensor"):
                load_model(directory, dtype="float32")
