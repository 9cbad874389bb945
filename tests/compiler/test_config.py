"""Compile settings: what `apply_inductor_settings` tells Inductor for each target."""

from __future__ import annotations

import pytest
import torch._inductor.config as inductor_config

from compiler.config import (
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
    monkeypatch.setenv(INDUCTOR_PDL_ENV, env)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    # The settings are process-wide: the patch restores them after the test.
    with inductor_config.patch({"triton.enable_pdl": not want, "fx_graph_cache": True}):
        apply_inductor_settings(CompileConfig(target=target, cache_dir=tmp_path))
        assert inductor_config.triton.enable_pdl is want
