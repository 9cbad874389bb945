"""quantization= as an engine setting: validated, taken from the command line, recorded in an
artifact (its cache key and the quantized layers) and enforced when the artifact loads."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from compile_engine.compiler.artifact import (
    Manifest,
    code_hash,
    device_description,
    model_fingerprint,
    versions,
)
from compile_engine.kernels_generated import tuning
from compile_engine.runtime.engine_args import add_engine_arguments, engine_kwargs
from compile_engine.runtime.engine_config import EngineConfig, EngineConfigError

QUANTIZED = {
    "method": "online-fp8",
    "scheme": "fp8_e4m3:channel:token",
    "weight_scale": "channel",
    "block": None,
    "activation": "token",
    "scale_name": "weight_scale",
    "ignore": [],
    "layers": ["model.layers.0.self_attn.qkv_proj"],
}


def test_the_setting_is_validated_and_comes_from_the_flag():
    assert EngineConfig(model="m", target="cpu", quantization="fp8").quantization == "fp8"
    with pytest.raises(EngineConfigError, match="quantization='int4' is not supported"):
        EngineConfig(model="m", target="cpu", quantization="int4")
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_kwargs(parser.parse_args(["m", "--quantization", "fp8"]))["quantization"] == "fp8"
    assert engine_kwargs(parser.parse_args(["m"]))["quantization"] is None
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--quantization", "awq"])


def _manifest(tmp_path, quantization: str | None) -> Manifest:
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
        engine_args={"quantization": quantization},
        passes=[],
        pass_manager_uuid="",
        compile={},
        kernels=[],
        timings={},
        kernel_config=tuning.default().describe(),
        quantization=QUANTIZED if quantization else None,
    )


def test_the_manifest_records_the_quantized_layers_and_keys_on_the_scheme(tmp_path):
    plain, fp8 = _manifest(tmp_path, None), _manifest(tmp_path, "fp8")
    assert plain.cache_key != fp8.cache_key
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    fp8.write(artifact)
    assert Manifest.read(artifact).quantization == QUANTIZED


@pytest.mark.parametrize(("built", "asked"), [(None, "fp8"), ("fp8", None)])
def test_an_artifact_loads_with_its_own_quantization(tmp_path, built, asked):
    from compile_engine.runtime.engine import LLMEngine

    artifact = tmp_path / "artifact"
    artifact.mkdir()
    replace(_manifest(tmp_path, built)).write(artifact)
    config = EngineConfig(model=str(artifact), target="cpu", quantization=asked)
    if asked is not None:
        with pytest.raises(EngineConfigError, match="built with quantization=None, not 'fp8'"):
            LLMEngine(config)
    else:
        with pytest.raises(Exception) as later:  # the empty model fails later, not here
            LLMEngine(config)
        assert "quantization" not in str(later.value)
        assert config.quantization == "fp8"  # taken from the artifact
