"""The default KV pool's size: max_num_seqs sequences of max_model_len, or kv_pool_sequences of
them when a caller knows its requests (`compile-engine generate` serves one)."""

from __future__ import annotations

import pytest

from compile_engine import SamplingParams
from compile_engine.runtime.engine import EngineConfig, EngineConfigError, LLMEngine
from compile_engine.runtime.model_runner import CPU_KV_SEQUENCES

from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama-pool")
    make_tiny_model("llama", directory)
    return directory


def _engine(directory, **kwargs) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(directory), dtype="float32", target="cpu", enforce_eager=True,
            max_model_len=64, max_num_seqs=8, **kwargs,
        )
    )  # fmt: skip


def test_the_pool_holds_the_sequences_it_is_sized_for(tiny_dir):
    # 64 tokens are 4 blocks of 16, plus the scratch block 0; on the CPU CPU_KV_SEQUENCES of
    # the 8 sequences (issue 29: a 4 GiB pool held a 135M model's server at 5.3 GB).
    assert CPU_KV_SEQUENCES < 8
    assert _engine(tiny_dir).scheduler.config.num_blocks == CPU_KV_SEQUENCES * 4 + 1
    one = _engine(tiny_dir, kv_pool_sequences=1)
    assert one.scheduler.config.num_blocks == 4 + 1
    # ... and a request of the full length still runs in it.
    one.add_request("r", list(range(1, 40)), SamplingParams(temperature=0, max_tokens=24))
    while one.has_unfinished_requests():
        one.step()
    one.scheduler.check_integrity()


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_a_bad_pool_size_is_refused(tiny_dir, bad):
    with pytest.raises(EngineConfigError, match="kv_pool_sequences"):
        _engine(tiny_dir, kv_pool_sequences=bad)


def test_the_generate_command_sizes_the_pool_for_its_one_request(tiny_dir, monkeypatch):
    from compile_engine import cli
    from compile_engine.runtime import progress

    seen = []

    class Stop(Exception):
        pass

    def fake_engine(config, **kwargs):
        seen.append(config)
        raise Stop

    monkeypatch.setattr(progress, "LLMEngine", fake_engine)  # what start_engine constructs
    with pytest.raises(Stop):
        cli.main(["generate", str(tiny_dir), "hi", "--target", "cpu", "--enforce-eager"])
    assert seen[0].kv_pool_sequences == 1 and seen[0].num_kv_blocks is None


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_a_bad_cuda_graph_bound_is_refused(tiny_dir, bad):
    with pytest.raises(EngineConfigError, match="max_cuda_graph_tokens"):
        _engine(tiny_dir, max_cuda_graph_tokens=bad)
