"""EAGLE-3 heads and DeepSeek-V3's MTP layer as proposers (#33): they load in the published
layouts (a tiny EAGLE-3 head directory, a tiny DeepSeek-V3 checkpoint with its MTP layer) and
greedy tokens equal non-speculative decoding's, with random heads (drafts mostly rejected)
and with heads that agree with their target (every draft accepted: the accept path, multi-
token steps, the head's KV past accepted drafts). Also: sampled requests get a draft
distribution, preemption keeps tokens exact, the target exposes its aux hidden states, and
the catch-up reads features that match a from-scratch run of the head."""

from __future__ import annotations

import json

import pytest
import torch

from compile_engine import LLM, SamplingParams
from compile_engine.runtime.engine_config import EngineConfig, EngineConfigError

from oracle import GREEDY, mixed_prompts
from tiny_deepseek import make_tiny_deepseek
from tiny_heads import make_constant_target, make_tiny_eagle3
from tiny_models import make_tiny_model

# Every draft verified at the config's k (the per-step choice of k is test_spec_policy.py's).
ALWAYS = dict(min_acceptance_rate=0.0, adaptive=False)


def eager(directory, **settings) -> LLM:
    return LLM(str(directory), dtype="float32", target="cpu", enforce_eager=True, **settings)


def prompts(vocab: int = 96) -> list[list[int]]:
    return mixed_prompts(vocab, seed=3)[:5] + [[5, 6, 7] * 4]


def _greedy(llm: LLM, batch) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)]


def _check_clean(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 0, "nothing was speculated"
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
    llm.engine.scheduler.check_integrity()
    proposer = llm.engine.runner.speculator.proposer
    assert not proposer.sequences and proposer.kv.usage == 0.0  # every head sequence freed


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    make_tiny_model("llama", directory)
    return directory


def test_an_eagle3_head_loads_and_greedy_equals_non_speculative(llama, tmp_path):
    # Aux ids 0 (the embedding), 1 and 2 (the last layer's output): the ends of the range.
    head = make_tiny_eagle3(llama, tmp_path / "head", aux_layer_ids=[0, 1, 2])
    batch = prompts()
    want = _greedy(eager(llama), batch)
    spec = dict(method="eagle3", model=str(head), num_speculative_tokens=3, **ALWAYS)
    llm = eager(llama, speculative_config=spec)
    assert _greedy(llm, batch) == want
    _check_clean(llm)
    loaded = llm.engine.runner.speculator.proposer.head
    assert loaded.eagle.aux_layer_ids == (0, 1, 2) and loaded.embed_tokens is None
    # The published names: d2t maps the 64-token draft vocabulary into the target's 96.
    assert loaded.d2t.shape == (64,) and int(loaded.d2t.max()) > 0
    # A smaller pool, chunked prefill and preemption: still exact.
    small = dict(block_size=4, num_kv_blocks=14, max_num_batched_tokens=16)
    llm = eager(llama, speculative_config=spec, **small)
    assert _greedy(llm, batch) == want
    assert llm.engine.stats().num_preemptions_total > 0
    _check_clean(llm)


def test_an_eagle3_head_that_agrees_with_its_target_has_every_draft_accepted(tmp_path):
    target = tmp_path / "target"
    make_constant_target(make_tiny_model, "llama", target)
    head = make_tiny_eagle3(target, tmp_path / "head", constant=True)  # default aux ids
    batch = prompts()
    want = _greedy(eager(target), batch)
    assert all(t == [0] * len(t) for t in want)
    spec = dict(method="eagle3", model=str(head), num_speculative_tokens=4, **ALWAYS)
    llm = eager(target, speculative_config=spec)
    assert _greedy(llm, batch) == want
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
    assert stats.spec_accepted_per_pos[3] > 0
    _check_clean(llm)


def test_sampled_requests_take_the_heads_distribution(llama, tmp_path):
    head = make_tiny_eagle3(llama, tmp_path / "head", draft_vocab_size=96)
    spec = dict(method="eagle3", model=str(head), num_speculative_tokens=2, **ALWAYS)
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = eager(llama, speculative_config=spec)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts(), params)])
    assert runs[0] == runs[1] and all(len(t) == 8 for t in runs[0])
    _check_clean(llm)


def test_the_catch_up_matches_a_from_scratch_run_of_the_head(llama, tmp_path):
    """After a generation, the head's first draft for a request equals the head's argmax
    computed over the whole sequence at once from the target's features (no KV reuse)."""
    head_dir = make_tiny_eagle3(llama, tmp_path / "head", aux_layer_ids=[1, 1, 2])
    spec = dict(method="eagle3", model=str(head_dir), num_speculative_tokens=1, **ALWAYS)
    llm = eager(llama, speculative_config=spec)
    engine = llm.engine
    prompt = mixed_prompts(96, seed=9)[2]
    proposer = engine.runner.speculator.proposer
    seen = []
    propose = proposer.propose

    def spy(wanted):
        drafted = propose(wanted)
        for request, _ in wanted:
            if request.request_id in drafted:
                seen.append((list(request.all_token_ids), drafted[request.request_id][0]))
        return drafted

    proposer.propose = spy
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert seen
    tokens, draft = seen[-1]
    # From scratch: the target's aux states at every position, the head over all of them.
    target, head = engine.loaded.model, proposer.head
    n = len(tokens) - 1
    kv = [torch.zeros(k.shape) for k in engine.runner.kv_caches]
    head_kv = [torch.zeros(k.shape) for k in proposer.kv_caches]
    from compile_engine.runtime.speculative_heads import _metadata

    positions, meta = _metadata([([1, 2, 3, 4, 5], 0, n)], engine.config.block_size, "cpu")
    with torch.inference_mode():
        out = target(torch.tensor(tokens[:n]), positions, kv, meta)
        features = out[:, target.config.hidden_size :]
        ids = torch.tensor(tokens[1 : n + 1])
        h = head(proposer.embed(ids), positions, head.fuse(features), head_kv, meta)
        want = int(head.compute_logits(h[-1:], None).argmax(-1))
    assert draft == want


def test_the_target_exposes_its_aux_hidden_states(llama):
    from compile_engine.models.loader import load_model

    loaded = load_model(str(llama), dtype="float32")
    from compile_engine.runtime.speculative_heads import _metadata

    positions, meta = _metadata([([1], 0, 3)], 16, "cpu")
    kv = [torch.zeros(loaded.model.kv_cache_shape(4, 16)) for _ in range(2)]
    ids = torch.tensor([3, 4, 5])
    with torch.inference_mode():
        plain = loaded.model(ids, positions, kv, meta)
        loaded.model.expose_aux_hidden_states((0, 2))
        wide = loaded.model(ids, positions, kv, meta)
    h = loaded.config.hidden_size
    assert wide.shape == (3, 3 * h)
    torch.testing.assert_close(wide[:, :h], plain)
    embed = loaded.model.model.embed_tokens(ids)
    torch.testing.assert_close(wide[:, h : 2 * h], embed)  # id 0: the residual stream in


def test_config_refuses_what_it_cannot_run(llama, tmp_path):
    with pytest.raises(EngineConfigError, match="method='eagle' is not implemented yet"):
        EngineConfig(
            "x", target="cpu", speculative_config={"method": "eagle", "num_speculative_tokens": 2}
        )
    with pytest.raises(EngineConfigError, match="needs model"):
        EngineConfig(
            "x", target="cpu", speculative_config={"method": "eagle3", "num_speculative_tokens": 2}
        )
    # MTP on a target without MTP layers; an EAGLE-3 head of another vocabulary.
    with pytest.raises(Exception, match="DeepSeek-V3"):
        eager(llama, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    other = tmp_path / "other"
    make_tiny_model("llama", other)
    raw = json.loads((other / "config.json").read_text())
    raw["vocab_size"] = 128
    (other / "config.json").write_text(json.dumps(raw))
    head = make_tiny_eagle3(other, tmp_path / "head")
    with pytest.raises(Exception, match="vocabulary"):
        eager(
            llama,
            speculative_config={
                "method": "eagle3",
                "model": str(head),
                "num_speculative_tokens": 2,
            },
        )


# -- DeepSeek-V3 MTP ----------------------------------------------------------------------------


def test_the_mtp_layer_loads_and_greedy_equals_non_speculative(tmp_path):
    make_tiny_deepseek("deepseek-v3", tmp_path, mtp=True)
    batch = prompts()
    want = _greedy(eager(tmp_path), batch)  # the target skips the MTP layer's tensors
    spec = dict(method="mtp", num_speculative_tokens=2, **ALWAYS)
    llm = eager(tmp_path, speculative_config=spec)
    assert _greedy(llm, batch) == want
    _check_clean(llm)
    head = llm.engine.runner.speculator.proposer.head
    assert head.mlp.__class__.__name__ == "SparseMoE"  # index 3 > first_k_dense_replace


def test_an_mtp_layer_that_agrees_with_its_target_has_every_draft_accepted(tmp_path):
    from tiny_deepseek import add_mtp_layer

    model = make_constant_target(make_tiny_deepseek, "deepseek-v3", tmp_path)
    add_mtp_layer(model, tmp_path)
    from safetensors.torch import load_file, save_file

    file = tmp_path / "model-mtp.safetensors"
    tensors = load_file(file)
    tensors["model.layers.3.shared_head.norm.weight"].zero_()
    save_file(tensors, str(file), metadata={"format": "pt"})
    batch = prompts()[:3]
    want = _greedy(eager(tmp_path), batch)
    spec = dict(method="mtp", num_speculative_tokens=3, **ALWAYS)
    llm = eager(tmp_path, speculative_config=spec)
    assert _greedy(llm, batch) == want
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
    _check_clean(llm)


def test_bench_latency_records_one_draft_step(llama, tmp_path):
    from compile_engine.benchmarks import latency

    head = make_tiny_eagle3(llama, tmp_path / "head")
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2}
    argv = ["--model", str(llama), "--target", "cpu", "--dtype", "float32", "--enforce-eager"]
    argv += ["--batch-sizes", "1", "--input-len", "5", "--output-len", "6", "--num-iters", "1"]
    argv += ["--copy-rate", "1e10", "--results-dir", str(tmp_path / "out")]
    assert latency.main([*argv, "--speculative-config", json.dumps(spec)]) == 0
    (record,) = (tmp_path / "out").glob("*.json")
    data = json.loads(record.read_text())
    assert 0 < data["spec_draft_step_ms_bs1"] < 1e3
    assert data["engine"]["speculative_config"]["method"] == "eagle3"
