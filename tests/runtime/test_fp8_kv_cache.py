"""kv_cache_dtype="fp8" on CPU: the setting (validated, from the flag, in the artifact and its
cache key), the pool (float8_e4m3fn blocks, twice as many in the same bytes), the checkpoint's
k/v scales by every name vLLM reads, and a tiny Llama whose FP8-cache logits stay close to its
model-dtype cache's, through the harness, LLM.generate eager and compiled (the CPU attention
pass routes FP8 caches to the reference). The kernels' FP8 cases are in
tests/kernels/test_paged_attention.py (interpreted)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fp8_models import make_tiny_llama
from safetensors.torch import load_file, save_file

from compile_engine.compiler.artifact import (
    Manifest,
    code_hash,
    device_description,
    model_fingerprint,
    versions,
)
from compile_engine.kernels_generated import tuning
from compile_engine.models.errors import CheckpointError, UnsupportedModelError
from compile_engine.models.loader import load_model
from compile_engine.models.ops import KV_FP8_DTYPE, kv_cache_torch_dtype
from compile_engine.runtime.engine_args import add_engine_arguments, engine_kwargs
from compile_engine.runtime.engine_config import EngineConfig, EngineConfigError
from compile_engine.runtime.model_runner import (
    allocate_kv_caches,
    default_num_blocks,
    kv_bytes_per_block,
    profile_inputs,
)

from paged_harness import PagedHarness, run_schedule

SEQUENCES = [[5, 17, 3, 44, 9, 61, 2, 8, 30, 11, 7], [12, 40, 6, 33, 90, 4]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("llama-fp32"))


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def test_the_setting_is_validated_and_comes_from_the_flag():
    assert EngineConfig(model="m", target="cpu", kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    assert EngineConfig(model="m", target="cpu").kv_cache_dtype == "auto"
    with pytest.raises(EngineConfigError, match="kv_cache_dtype='fp8_e5m2' is not supported"):
        EngineConfig(model="m", target="cpu", kv_cache_dtype="fp8_e5m2")
    with pytest.raises(EngineConfigError, match="tensor-parallel"):
        EngineConfig(model="m", target="cpu", kv_cache_dtype="fp8", tensor_parallel_size=2)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["m", "--kv-cache-dtype", "fp8_e4m3"])
    assert engine_kwargs(args)["kv_cache_dtype"] == "fp8_e4m3"
    assert engine_kwargs(parser.parse_args(["m"]))["kv_cache_dtype"] == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--kv-cache-dtype", "int8"])
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == KV_FP8_DTYPE
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="use one of auto, fp8, fp8_e4m3"):
        kv_cache_torch_dtype("fp16", torch.bfloat16)


def test_the_pool_holds_fp8_blocks_twice_as_many_in_the_same_memory(tiny):
    bf16 = load_model(tiny, dtype="bfloat16")
    fp8 = load_model(tiny, dtype="bfloat16", kv_cache_dtype="fp8")
    assert bf16.cache_dtype == torch.bfloat16 and fp8.cache_dtype == KV_FP8_DTYPE
    assert kv_bytes_per_block(bf16, 16) == 2 * kv_bytes_per_block(fp8, 16)
    huge = 1 << 30  # more tokens than the CPU budget holds: the budget decides
    cpu = torch.device("cpu")
    assert default_num_blocks(fp8, 16, cpu, huge) == 2 * default_num_blocks(bf16, 16, cpu, huge)
    caches = allocate_kv_caches(fp8, 6, 16, cpu)
    assert len(caches) == fp8.config.num_layers
    assert all(c.dtype == KV_FP8_DTYPE and c.shape[1] == 6 for c in caches)


def test_the_activation_profile_step_stays_inside_the_rotary_table(tiny):
    """The pool is sized after an eager forward of the largest step (max_num_batched_tokens,
    past max_position_embeddings here); its positions must stay inside the rotary table. On
    CUDA an index past it was a device-side assert (seen in the FP8-cache engine's start)."""
    loaded = load_model(tiny, dtype="bfloat16", kv_cache_dtype="fp8")
    table = loaded.config.max_position_embeddings
    ids, positions, kv, meta = profile_inputs(loaded, 2 * table + 5)
    assert int(positions.max()) == table - 1 and positions.numel() == 2 * table + 5
    with torch.inference_mode():
        hidden = loaded.model(ids, positions, kv, meta)
    assert hidden.shape[0] == 2 * table + 5 and torch.isfinite(hidden.float()).all()
    assert all(c.dtype == KV_FP8_DTYPE for c in kv)


def _with_kv_scales(source: Path, out: Path, names: dict[str, float]) -> Path:
    """`source`'s checkpoint plus KV-scale tensors `names` (name -> value) for every layer."""
    out.mkdir()
    tensors = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    for layer in range(config["num_hidden_layers"]):
        for suffix, value in names.items():
            tensors[f"model.layers.{layer}.self_attn.{suffix}"] = torch.tensor(value)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(
    "names",
    [
        {"k_scale": 0.5, "v_scale": 0.25},  # compressed-tensors (llm-compressor)
        {"k_proj.k_scale": 0.5, "v_proj.v_scale": 0.25},  # NVIDIA ModelOpt
        {"k_proj.output_scale": 0.5, "v_proj.output_scale": 0.25},  # older llm-compressor
    ],
    ids=["compressed-tensors", "modelopt", "output-scale"],
)
def test_kv_scales_load_by_every_checkpoint_name(tiny, tmp_path, names):
    loaded = load_model(_with_kv_scales(tiny, tmp_path / "scaled", names), kv_cache_dtype="fp8")
    for layer in loaded.model.model.layers:
        attn = layer.self_attn
        assert attn.k_scale.dtype == torch.float32 and attn.k_scale.shape == ()
        assert float(attn.k_scale) == 0.5 and float(attn.v_scale) == 0.25
    plain = load_model(tiny)  # no scales in the checkpoint: 1.0
    assert float(plain.model.model.layers[0].self_attn.k_scale) == 1.0


def test_a_kv_scale_of_many_values_is_refused(tiny, tmp_path):
    out = _with_kv_scales(tiny, tmp_path / "bad", {})
    tensors = load_file(str(out / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_scale"] = torch.ones(2)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="one value"):
        load_model(out)


def test_fp8_cache_logits_stay_close_to_the_model_dtype_cache(tiny, tmp_path):
    # Chunked prefill and decode packed together (the harness), the reference op: the same
    # weights with an FP8 cache at scale 1.0, and with the checkpoint's scales.
    model = load_model(tiny).model
    want = torch.cat(run_schedule(PagedHarness(model, 4, 32), SEQUENCES, 4, 2))
    fp8 = PagedHarness(model, 4, 32, kv_cache_dtype=KV_FP8_DTYPE)
    got = torch.cat(run_schedule(fp8, SEQUENCES, 4, 2))
    assert all(c.dtype == KV_FP8_DTYPE for c in fp8.kv_caches)
    assert _cosine(got, want) >= 0.99
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    assert not torch.equal(got, want)  # the cache is FP8 indeed
    scaled = load_model(
        _with_kv_scales(tiny, tmp_path / "scaled", {"k_scale": 0.01, "v_scale": 0.01})
    )
    got_scaled = torch.cat(
        run_schedule(
            PagedHarness(scaled.model, 4, 32, kv_cache_dtype=KV_FP8_DTYPE), SEQUENCES, 4, 2
        )
    )
    assert _cosine(got_scaled, want) >= 0.99


def test_mla_refuses_an_fp8_cache_by_name(tmp_path):
    from tiny_deepseek import make_tiny_deepseek

    make_tiny_deepseek("deepseek-v2", tmp_path / "ds")
    with pytest.raises(UnsupportedModelError, match="MLA's latent cache has no FP8 form"):
        load_model(tmp_path / "ds", kv_cache_dtype="fp8")


def _greedy(tiny: Path, **engine) -> tuple[list[list[int]], object]:
    from compile_engine.runtime.llm import LLM
    from compile_engine.runtime.sampling_params import SamplingParams

    llm = LLM(str(tiny), dtype="float32", target="cpu", block_size=4, num_kv_blocks=64, **engine)
    params = SamplingParams(temperature=0, max_tokens=12)
    outs = llm.generate([list(s) for s in SEQUENCES], params)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.slow
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
def test_generate_with_an_fp8_cache(tiny, enforce_eager):
    want, _ = _greedy(tiny, enforce_eager=True)
    got, llm = _greedy(tiny, enforce_eager=enforce_eager, kv_cache_dtype="fp8")
    assert all(c.dtype == KV_FP8_DTYPE for c in llm.engine.runner.kv_caches)
    same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    assert same >= 0.75 * sum(len(w) for w in want), (got, want)
    llm.engine.scheduler.check_integrity()


def _manifest(tmp_path, kv_cache_dtype: str) -> Manifest:
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
        engine_args={"kv_cache_dtype": kv_cache_dtype},
        passes=[],
        pass_manager_uuid="",
        compile={
            "num_pieces": 0,
            "num_attention_pieces": 0,
            "num_compiled_pieces": 0,
            "pieces": [],
        },
        kernels=[],
        timings={},
        kernel_config=tuning.default().describe(),
        kv_cache_dtype="float8_e4m3fn" if kv_cache_dtype != "auto" else "float32",
    )


def test_the_manifest_keys_on_an_fp8_cache(tmp_path):
    plain, fp8 = _manifest(tmp_path, "auto"), _manifest(tmp_path, "fp8")
    assert plain.cache_key != fp8.cache_key
    legacy = _manifest(tmp_path, "auto")
    legacy.kv_cache_dtype = None  # an artifact from before the field: the same key as "auto"
    assert legacy.cache_key == plain.cache_key
    assert "--kv-cache-dtype fp8" in fp8.rebuild_hint(tmp_path)
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    fp8.write(artifact)
    assert Manifest.read(artifact).kv_cache_dtype == "float8_e4m3fn"


def test_inspect_lists_the_kv_cache_dtype(tmp_path, capsys):
    from compile_engine.cli import main

    artifact = tmp_path / "artifact"
    artifact.mkdir()
    _manifest(tmp_path, "fp8").write(artifact)
    assert main(["inspect", str(artifact)]) == 0
    assert "kv cache   float8_e4m3fn (kv_cache_dtype fp8)" in capsys.readouterr().out


@pytest.mark.parametrize(("built", "asked"), [("auto", "fp8"), ("fp8", "auto")])
def test_an_artifact_loads_with_its_own_kv_cache_dtype(tmp_path, built, asked):
    from compile_engine.runtime.engine import LLMEngine

    artifact = tmp_path / "artifact"
    artifact.mkdir()
    _manifest(tmp_path, built).write(artifact)
    config = EngineConfig(model=str(artifact), target="cpu", kv_cache_dtype=asked)
    if asked != "auto":
        with pytest.raises(EngineConfigError, match="built with kv_cache_dtype='auto', not 'fp8'"):
            LLMEngine(config)
    else:
        with pytest.raises(Exception) as later:  # the empty model fails later, not here
            LLMEngine(config)
        assert "kv_cache_dtype" not in str(later.value)
        assert config.kv_cache_dtype == "fp8"  # taken from the artifact
