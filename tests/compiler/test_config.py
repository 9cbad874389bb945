"""Compile settings: what `apply_inductor_settings` tells Inductor for each target, and the
kernel config an artifact records and a load of it keeps."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch._inductor.config as inductor_config

from compile_engine.compiler.artifact import (
    FORMAT_VERSION,
    ArtifactError,
    Manifest,
    code_hash,
    device_description,
    model_fingerprint,
    versions,
)
from compile_engine.compiler.config import CompileConfig, apply_inductor_settings
from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.tuning import KernelConfig


@pytest.mark.parametrize("target", ["h100", "cpu"])
def test_inductors_pdl_is_off_whatever_the_environment_says(target, tmp_path, monkeypatch):
    # It enters Inductor's cache key: build and load must agree, so the shell cannot choose.
    from torch._inductor.runtime import compile_tasks

    monkeypatch.setattr(compile_tasks, "_set_triton_ptxas_path", lambda: None)
    monkeypatch.setenv("TORCHINDUCTOR_ENABLE_PDL", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    # The settings are process-wide: the patch restores them after the test.
    with inductor_config.patch({"triton.enable_pdl": True, "fx_graph_cache": True}):
        apply_inductor_settings(CompileConfig(target=target, cache_dir=tmp_path))
        assert inductor_config.triton.enable_pdl is False


@pytest.mark.parametrize(("target", "pinned"), [("h100", True), ("cpu", False)])
def test_h100_settings_pin_triton_to_inductors_ptxas(target, pinned, tmp_path, monkeypatch):
    # The ptxas Triton uses enters every kernel's cache key. Inductor switches to torch's own
    # only when it compiles in this process, so the h100 settings switch first: otherwise a
    # load that compiles Inductor's kernels here recompiles all of ours.
    from torch._inductor.runtime import compile_tasks

    calls = []
    monkeypatch.setattr(compile_tasks, "_set_triton_ptxas_path", lambda: calls.append("ptxas"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    with inductor_config.patch({"fx_graph_cache": True}):
        apply_inductor_settings(CompileConfig(target=target, cache_dir=tmp_path))
    assert (calls == ["ptxas"]) is pinned


def _manifest(tmp_path, kernel: KernelConfig) -> Manifest:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return Manifest(
        model_path=str(model),
        model_kind="hf",
        model_fingerprint=model_fingerprint(model),
        architecture="LlamaForCausalLM",
        dtype="float32",
        target="cpu",
        device=device_description("cpu"),
        code_hash=code_hash(),
        versions=versions(),
        engine_args={},
        passes=[],
        pass_manager_uuid="",
        compile={},
        kernels=[],
        timings={},
        kernel_config=kernel.describe(),
    )


def test_the_manifest_records_the_kernel_config_and_its_key_enters_the_cache_key(tmp_path):
    off = KernelConfig(pdl=False)
    manifest = _manifest(tmp_path, off)
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    manifest.write(artifact)
    read = Manifest.read(artifact)
    assert read.kernel() == off and read.kernel().key == off.key
    read.check(artifact)  # this machine and this code reproduce it
    assert _manifest(tmp_path, tuning.default()).cache_key != manifest.cache_key


def test_an_artifact_whose_tuning_tables_changed_since_is_refused(tmp_path):
    table = tmp_path / "rotary.json"
    table.write_bytes(tuning.default().table_path("rotary").read_bytes())
    manifest = _manifest(tmp_path, KernelConfig(tables={"rotary": str(table)}))
    manifest.check(tmp_path)
    data = json.loads(table.read_text())
    data["default"]["num_warps"] = 8
    table.write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="kernel tuning tables as they were then"):
        manifest.check(tmp_path)


def test_an_artifact_of_the_previous_format_is_refused_with_the_rebuild_command(tmp_path):
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    data = json.loads(_manifest(tmp_path, tuning.default()).write(artifact).read_text())
    data["format"] = FORMAT_VERSION - 1
    (artifact / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="rebuild it with `compile-engine build`"):
        Manifest.read(artifact)


def test_loading_an_artifact_with_another_kernel_config_is_refused(tmp_path):
    from compile_engine.runtime.engine import EngineConfig, EngineConfigError, LLMEngine

    artifact = tmp_path / "artifact"
    artifact.mkdir()
    replace(_manifest(tmp_path, KernelConfig(pdl=False))).write(artifact)
    config = EngineConfig(model=str(artifact), target="cpu", kernel_config={"pdl": True})
    with pytest.raises(EngineConfigError, match="built with another kernel config"):
        LLMEngine(config)


@pytest.mark.parametrize("dtype", ["float16", "half", "bfloat16"])
def test_loading_an_artifact_with_another_dtype_is_refused_with_the_rebuild_command(
    tmp_path, dtype
):
    # Issue 31: `serve ART --dtype float16` on an artifact of another dtype was accepted.
    from compile_engine.runtime.engine import EngineConfig, EngineConfigError, LLMEngine

    artifact = tmp_path / "artifact"
    artifact.mkdir()
    _manifest(tmp_path, tuning.default()).write(artifact)  # a float32 artifact
    with pytest.raises(EngineConfigError, match="built for dtype float32, not ") as refused:
        LLMEngine(EngineConfig(model=str(artifact), target="cpu", dtype=dtype))
    assert "compile-engine build" in str(refused.value)
    # Its own dtype, in either spelling, is what the artifact is.
    for same in ("float32", "float"):
        with pytest.raises(Exception) as other:
            LLMEngine(EngineConfig(model=str(artifact), target="cpu", dtype=same))
        assert "built for dtype" not in str(other.value)  # fails later: the model is empty


def test_engine_config_takes_a_kernel_config_as_json_and_names_a_bad_field():
    from compile_engine.runtime.engine import EngineConfig, EngineConfigError

    config = EngineConfig(model="m", target="cpu", kernel_config='{"pdl_prefetch_tiles": 2}')
    assert config.kernel_config == KernelConfig(pdl_prefetch_tiles=2)
    with pytest.raises(EngineConfigError, match="unknown kernel config fields \\['pdll'\\]"):
        EngineConfig(model="m", target="cpu", kernel_config={"pdll": False})
    with pytest.raises(EngineConfigError, match="is not JSON"):
        EngineConfig(model="m", target="cpu", kernel_config="{pdl: off")
