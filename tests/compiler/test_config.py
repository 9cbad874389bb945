"""Compile settings: what `apply_inductor_settings` tells Inductor for each target."""

from __future__ import annotations

import json

import pytest
import torch._inductor.config as inductor_config

from compile_engine.compiler.config import (
    INDUCTOR_PDL_ENV,
    CompileConfig,
    CompileConfigError,
    apply_inductor_settings,
    inductor_pdl,
)


def test_inductor_pdl_is_on_only_when_asked_for_and_only_for_h100(monkeypatch):
    monkeypatch.delenv(INDUCTOR_PDL_ENV, raising=False)
    assert not inductor_pdl(CompileConfig(target="h100"))
    monkeypatch.setenv(INDUCTOR_PDL_ENV, "1")
    assert inductor_pdl(CompileConfig(target="h100"))
    assert not inductor_pdl(CompileConfig(target="cpu"))
    monkeypatch.setenv(INDUCTOR_PDL_ENV, "0")
    assert not inductor_pdl(CompileConfig(target="h100"))
    monkeypatch.setenv(INDUCTOR_PDL_ENV, "yes")
    with pytest.raises(CompileConfigError, match="set it to 1 .on. or 0"):
        inductor_pdl(CompileConfig(target="h100"))


@pytest.mark.parametrize(
    ("target", "env", "want"), [("h100", "1", True), ("h100", "0", False), ("cpu", "1", False)]
)
def test_apply_inductor_settings_sets_pdl(target, env, want, tmp_path, monkeypatch):
    from torch._inductor.runtime import compile_tasks

    monkeypatch.setattr(compile_tasks, "_set_triton_ptxas_path", lambda: None)
    monkeypatch.setenv(INDUCTOR_PDL_ENV, env)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    # The settings are process-wide: the patch restores them after the test.
    with inductor_config.patch({"triton.enable_pdl": not want, "fx_graph_cache": True}):
        apply_inductor_settings(CompileConfig(target=target, cache_dir=tmp_path))
        assert inductor_config.triton.enable_pdl is want


@pytest.mark.parametrize(("target", "pinned"), [("h100", True), ("cpu", False)])
def test_h100_settings_pin_triton_to_inductors_ptxas(target, pinned, tmp_path, monkeypatch):
    # The ptxas Triton uses enters every kernel's cache key. Inductor switches to torch's own
    # only when it compiles in this process, so the h100 settings switch first: otherwise a
    # load that compiles Inductor's kernels here (PDL on) recompiles all of ours.
    from torch._inductor.runtime import compile_tasks

    calls = []
    monkeypatch.setattr(compile_tasks, "_set_triton_ptxas_path", lambda: calls.append("ptxas"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    with inductor_config.patch({"fx_graph_cache": True}):
        apply_inductor_settings(CompileConfig(target=target, cache_dir=tmp_path))
    assert (calls == ["ptxas"]) is pinned


def test_an_artifact_built_with_the_other_inductor_pdl_setting_is_refused(tmp_path, monkeypatch):
    # Inductor's PDL enters its cache key: loaded with the other setting, every piece would
    # compile again. The manifest records the build's setting and the load-time check names
    # the variable to set.
    from dataclasses import replace

    from compile_engine.compiler.artifact import (
        ArtifactError,
        Manifest,
        code_hash,
        device_description,
        model_fingerprint,
        versions,
    )

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    built = Manifest(
        model_path=str(model),
        model_kind="hf",
        model_fingerprint=model_fingerprint(model),
        architecture="LlamaForCausalLM",
        dtype="float32",
        target="h100",
        device=device_description("cpu"),
        code_hash=code_hash(),
        versions=versions(),
        engine_args={},
        passes=[],
        pass_manager_uuid="",
        compile={},
        kernels=[],
        timings={},
        inductor_pdl=True,
    )
    cpu = replace(built, target="cpu", inductor_pdl=False)
    monkeypatch.delenv(INDUCTOR_PDL_ENV, raising=False)
    cpu.check(tmp_path)  # agrees: nothing to refuse
    with pytest.raises(ArtifactError, match="TORCHINDUCTOR_ENABLE_PDL=1 .this process: 0"):
        replace(cpu, inductor_pdl=True).check(tmp_path)
    monkeypatch.setenv(INDUCTOR_PDL_ENV, "1")
    with pytest.raises(ArtifactError, match="TORCHINDUCTOR_ENABLE_PDL=1 .this process: 0"):
        replace(cpu, inductor_pdl=True).check(tmp_path)  # never on for the cpu target
    # A manifest written before the field existed reads as built with it off.
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    data = json.loads(built.write(artifact).read_text())
    del data["inductor_pdl"]
    (artifact / "manifest.json").write_text(json.dumps(data))
    assert Manifest.read(artifact).inductor_pdl is False
