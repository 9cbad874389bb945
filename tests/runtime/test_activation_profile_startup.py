"""The KV pool's activation reserve: measured on a cold start, read back on a warm one.

The measurement itself needs CUDA (peak allocator statistics), so here a stand-in profile
counts its calls and returns a peak that depends on the step size; the pool is sized with a
fixed device memory, as `torch.cuda.mem_get_info` would report it.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from compile_engine.models.loader import load_model
from compile_engine.runtime import activation_profile
from compile_engine.runtime.activation_profile import CACHE_SUBDIR, activation_bytes
from compile_engine.runtime.model_runner import default_num_blocks, kv_bytes_per_block

from tiny_models import make_tiny_model

GIB = 1 << 30


class CountingProfile:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, loaded, num_tokens: int, num_rows: int) -> int:
        self.calls += 1
        return 1000 * num_tokens + num_rows  # distinct for every (tokens, rows)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    make_tiny_model("llama", directory)
    return load_model(directory, dtype="float32", device="cpu")


def _pool(loaded, peak: int, monkeypatch) -> int:
    """What the engine sizes on an 8 GiB device with 6 GiB free, reserving 2 * peak."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (6 * GIB, 8 * GIB))
    return default_num_blocks(loaded, 16, torch.device("cuda"), 10**9, 2 * peak)


def _start(loaded, cache_dir, profile, *, tokens=2048, rows=256, device="H200", code="c1"):
    return activation_bytes(
        loaded,
        tokens,
        rows,
        cache_dir=cache_dir,
        device_name=device,
        code=code,
        profile=profile,
    )


def test_cold_start_measures_warm_start_reads_and_sizes_the_same_pool(
    loaded, tmp_path, monkeypatch
):
    profile = CountingProfile()
    cold, cached = _start(loaded, tmp_path, profile)
    assert (cold, cached, profile.calls) == (2048 * 1000 + 256, False, 1)
    warm, cached = _start(loaded, tmp_path, profile)
    assert (warm, cached, profile.calls) == (cold, True, 1)
    assert _pool(loaded, warm, monkeypatch) == _pool(loaded, cold, monkeypatch)
    # The reserve is real: a pool sized without it would be larger.
    per_block = kv_bytes_per_block(loaded, 16)
    assert _pool(loaded, 0, monkeypatch) - _pool(loaded, cold, monkeypatch) == pytest.approx(
        2 * cold / per_block, abs=1
    )


@pytest.mark.parametrize(
    "change",
    [
        {"tokens": 4096},
        {"rows": 8},
        {"device": "H100"},
        {"code": "c2"},
    ],
)
def test_any_change_of_the_key_measures_again(loaded, tmp_path, change):
    profile = CountingProfile()
    _start(loaded, tmp_path, profile)
    peak, cached = _start(loaded, tmp_path, profile, **change)
    assert not cached and profile.calls == 2
    assert peak == profile(loaded, change.get("tokens", 2048), change.get("rows", 256))


def test_model_config_dtype_and_torch_version_are_in_the_key(loaded, monkeypatch):
    key = activation_profile.profile_key(loaded, 2048, 256, "H200", "c1")
    wider = dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, vocab_size=97))
    assert activation_profile.profile_key(wider, 2048, 256, "H200", "c1") != key
    half = dataclasses.replace(loaded, dtype=torch.bfloat16)
    assert activation_profile.profile_key(half, 2048, 256, "H200", "c1") != key
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert activation_profile.profile_key(loaded, 2048, 256, "H200", "c1") != key


def test_without_a_cache_directory_every_start_measures(loaded):
    profile = CountingProfile()
    _start(loaded, None, profile)
    _, cached = _start(loaded, None, profile)
    assert not cached and profile.calls == 2


@pytest.mark.parametrize("content", ["{not json", '{"peak_bytes": -5}', '{"peak_bytes": "1"}'])
def test_a_damaged_entry_is_measured_again_and_replaced(loaded, tmp_path, content):
    profile = CountingProfile()
    cold, _ = _start(loaded, tmp_path, profile)
    (entry,) = (tmp_path / CACHE_SUBDIR).glob("*.json")
    entry.write_text(content)
    peak, cached = _start(loaded, tmp_path, profile)
    assert (peak, cached, profile.calls) == (cold, False, 2)
    assert json.loads(entry.read_text())["peak_bytes"] == cold


def test_an_unwritable_cache_still_measures(loaded, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the cache directory would go: mkdir fails
    profile = CountingProfile()
    peak, cached = _start(loaded, blocker, profile)
    assert (peak, cached) == (2048 * 1000 + 256, False)


def test_the_build_stores_what_a_start_from_the_artifact_looks_up(loaded, tmp_path, monkeypatch):
    """`compile-engine build` measures the peaks (build_step) where and as a start from the
    artifact looks them up (the engine's arguments), so a first start measures nothing."""
    from compile_engine.compiler.artifact import code_hash
    from compile_engine.compiler.build import CACHE_SUBDIR as ARTIFACT_CACHE

    monkeypatch.setattr(activation_profile, "_profiled_at_start", lambda loaded: True)
    monkeypatch.setattr(activation_profile, "device_description", lambda target: "H200")
    profile = CountingProfile()
    step = activation_profile.build_step([(2048, 256), (16384, 256), (2048, 256)], profile)
    step(loaded, tmp_path)
    assert profile.calls == 2  # each distinct step size once
    for tokens in (2048, 16384):
        # What LLMEngine passes for an artifact: its compile cache, the device, the code hash
        # the manifest records (the build's).
        peak = activation_profile.lookup(
            loaded,
            tokens,
            256,
            cache_dir=tmp_path / ARTIFACT_CACHE,
            device_name="H200",
            code=code_hash(),
        )
        assert peak == profile(loaded, tokens, 256)
    assert (
        activation_profile.lookup(
            loaded,
            4096,
            256,
            cache_dir=tmp_path / ARTIFACT_CACHE,
            device_name="H200",
            code=code_hash(),
        )
        is None
    )


def test_a_cpu_build_stores_no_profile(loaded, tmp_path):
    profile = CountingProfile()
    activation_profile.build_step([(2048, 256)], profile)(loaded, tmp_path)
    assert profile.calls == 0 and not any(tmp_path.iterdir())
