"""models.loader.load_model on HF directories: what loads, exactly what it loads, and the
one-line typed error for each way a checkpoint can be wrong.

Every case starts from a tiny random model written by save_pretrained and, where a broken
checkpoint is wanted, edits that directory the way a user's checkpoint could be broken.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from compile_engine.models.errors import CheckpointError, ModelNotFoundError, UnsupportedModelError
from compile_engine.models.loader import load_model
from compile_engine.models.registry import ARCHITECTURES

from tiny_models import TINY_ARCHS, make_tiny_model

# Which checkpoint tensors the engine stacks into one parameter, in stacking order. Written
# out here rather than read from the model so that a wrong table in the model fails the test.
FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    directory = tmp_path_factory.mktemp("llama")
    return directory, make_tiny_model("llama", directory)


@pytest.fixture
def llama_copy(llama_dir, tmp_path) -> Path:
    """A private copy of the tiny Llama directory that a test may break."""
    return Path(shutil.copytree(llama_dir[0], tmp_path / "model"))


def one_line_error(error: type[Exception], load: Callable[[], object]) -> str:
    with pytest.raises(error) as info:
        load()
    message = str(info.value)
    assert message and "\n" not in message, f"not a one-line message: {message!r}"
    return message


def edit_weights(directory: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def expected_parameters(hf_state: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """The engine's parameters as HF's state dict implies them: fused groups concatenated along
    the output dimension, everything else by name, lm_head dropped when tied."""
    expected: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in hf_state.items():
        if tied and name == "lm_head.weight":
            continue
        parts = name.split(".")
        fused = next(((f, p) for f, shards in FUSED.items() for p in parts if p in shards), None)
        if fused is None:
            expected[name] = tensor
            continue
        target = name.replace(f".{fused[1]}.", f".{fused[0]}.")
        groups.setdefault(target, {})[fused[1]] = tensor
    for target, shards in groups.items():
        fused_name = next(f for f in FUSED if f".{f}." in target)
        expected[target] = torch.cat([shards[s] for s in FUSED[fused_name]], dim=0)
    return expected


# --------------------------------------------------------------------------- what loads


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_every_parameter_comes_from_the_checkpoint(arch: str, tmp_path: Path) -> None:
    hf = make_tiny_model(arch, tmp_path)
    loaded = load_model(tmp_path, dtype="float32")
    ours = dict(loaded.model.named_parameters())
    expected = expected_parameters(hf.state_dict(), hf.config.tie_word_embeddings)
    assert sorted(ours) == sorted(expected)
    for name, tensor in expected.items():
        # Bit-exact over the whole tensor: a slice left as uninitialised memory cannot pass.
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=0, msg=name)
    # The q/k/v and gate/up slices sit where the model splits them at run time.
    attn = loaded.model.model.layers[1].self_attn
    q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
    hf_attn = hf.model.layers[1].self_attn
    for ours_w, hf_w in ((q, hf_attn.q_proj), (k, hf_attn.k_proj), (v, hf_attn.v_proj)):
        torch.testing.assert_close(ours_w, hf_w.weight, rtol=0, atol=0)
    for name, buffer in loaded.model.named_buffers():
        assert torch.isfinite(buffer).all(), name


def test_loading_twice_gives_identical_parameters(llama_dir) -> None:
    first = load_model(llama_dir[0]).model.state_dict()
    second = load_model(llama_dir[0]).model.state_dict()
    assert first.keys() == second.keys()
    for name in first:
        torch.testing.assert_close(first[name], second[name], rtol=0, atol=0, msg=name)


def test_sharded_checkpoint_equals_unsharded(llama_dir, tmp_path: Path) -> None:
    directory, hf = llama_dir
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    whole = load_model(directory).model.state_dict()
    parts = load_model(sharded).model.state_dict()
    assert whole.keys() == parts.keys()
    for name in whole:
        torch.testing.assert_close(parts[name], whole[name], rtol=0, atol=0, msg=name)


def test_missing_shard_named_in_index(llama_dir, tmp_path: Path) -> None:
    sharded = tmp_path / "sharded"
    llama_dir[1].save_pretrained(sharded, max_shard_size="100KB")
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    shard.unlink()
    message = one_line_error(CheckpointError, lambda: load_model(sharded))
    assert shard.name in message


@pytest.mark.parametrize(
    "dtype, expected",
    [
        ("auto", torch.float32),
        ("float32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_dtype(llama_dir, dtype, expected: torch.dtype) -> None:
    directory, hf = llama_dir
    loaded = load_model(directory, dtype=dtype)
    assert loaded.dtype == expected
    params = dict(loaded.model.named_parameters())
    assert {p.dtype for p in params.values()} == {expected}
    want = hf.model.layers[0].mlp.down_proj.weight.to(expected)
    torch.testing.assert_close(params["model.layers.0.mlp.down_proj.weight"], want, rtol=0, atol=0)


def test_dtype_auto_keeps_the_checkpoint_dtype(llama_dir, tmp_path: Path) -> None:
    copy.deepcopy(llama_dir[1]).to(torch.bfloat16).save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype="auto")
    assert loaded.dtype == torch.bfloat16
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}


def test_unknown_dtype_is_refused(llama_dir) -> None:
    message = one_line_error(ValueError, lambda: load_model(llama_dir[0], dtype="float8"))
    assert "float8" in message


def test_tied_embeddings_with_lm_head_in_checkpoint(tmp_path: Path) -> None:
    hf = make_tiny_model("llama-mha-tied", tmp_path)
    embed = hf.model.embed_tokens.weight.detach().clone()
    # Some exporters write the tied head out anyway; it is the same tensor and loads fine.
    edit_weights(tmp_path, lambda t: t.__setitem__("lm_head.weight", embed.clone()))
    assert "lm_head.weight" in load_file(str(tmp_path / "model.safetensors"))
    loaded = load_model(tmp_path, dtype="float32")
    assert loaded.model.lm_head is None
    hidden = torch.randn(3, hf.config.hidden_size)
    torch.testing.assert_close(loaded.model.compute_logits(hidden), hf.lm_head(hidden))


# --------------------------------------------------------------------------- what is refused


def test_unsupported_architecture(llama_copy: Path) -> None:
    edit_config(llama_copy, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    message = one_line_error(UnsupportedModelError, lambda: load_model(llama_copy))
    assert "GPT2LMHeadModel" in message
    for supported in ARCHITECTURES:
        assert supported in message


def test_missing_architectures_field(llama_copy: Path) -> None:
    path = llama_copy / "config.json"
    config = json.loads(path.read_text())
    del config["architectures"]
    path.write_text(json.dumps(config))
    message = one_line_error(UnsupportedModelError, lambda: load_model(llama_copy))
    assert "LlamaForCausalLM" in message


def test_remote_code_is_refused(llama_copy: Path) -> None:
    marker = llama_copy / "ran"
    (llama_copy / "configuration_custom.py").write_text(
        f"open({str(marker)!r}, 'w').write('remote code ran')\n"
    )
    edit_config(
        llama_copy,
        architectures=["CustomForCausalLM"],
        model_type="custom",
        auto_map={
            "AutoConfig": "configuration_custom.CustomConfig",
            "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM",
        },
    )
    message = one_line_error(UnsupportedModelError, lambda: load_model(llama_copy))
    assert "CustomForCausalLM" in message
    assert not marker.exists()


def test_missing_tensor(llama_copy: Path) -> None:
    name = "model.layers.1.self_attn.k_proj.weight"
    edit_weights(llama_copy, lambda t: t.pop(name))
    message = one_line_error(CheckpointError, lambda: load_model(llama_copy))
    assert name in message
    assert "q_proj" not in message and "v_proj" not in message


def test_half_a_fused_group(llama_copy: Path) -> None:
    # up_proj is present, gate_proj is not: gate_up_proj would be half garbage.
    name = "model.layers.0.mlp.gate_proj.weight"
    edit_weights(llama_copy, lambda t: t.pop(name))
    message = one_line_error(CheckpointError, lambda: load_model(llama_copy))
    assert name in message
    assert "up_proj" not in message


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.rotary_bias.weight",  # no such parameter
        "model.layers.2.mlp.up_proj.weight",  # a layer the config does not have
        "model.layers.0.self_attn.q_proj.bias",  # a bias this config does not use
    ],
)
def test_unexpected_tensor(llama_copy: Path, name: str) -> None:
    edit_weights(llama_copy, lambda t: t.__setitem__(name, torch.zeros(4)))
    message = one_line_error(CheckpointError, lambda: load_model(llama_copy))
    assert name in message


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.o_proj.weight",  # a plain parameter
        "model.layers.1.self_attn.v_proj.weight",  # one shard of a fused parameter
        "model.norm.weight",
    ],
)
def test_mis_shaped_tensor(llama_copy: Path, name: str) -> None:
    def shrink(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name][..., :-1].contiguous()

    edit_weights(llama_copy, shrink)
    message = one_line_error(CheckpointError, lambda: load_model(llama_copy))
    assert name in message


def test_no_weights_at_all(llama_copy: Path) -> None:
    (llama_copy / "model.safetensors").unlink()
    message = one_line_error(CheckpointError, lambda: load_model(llama_copy))
    assert "safetensors" in message


def test_pickle_checkpoint_directory(llama_dir, tmp_path: Path) -> None:
    # An HF directory saved the old way: config.json beside pytorch_model.bin.
    with_config = tmp_path / "with_config"
    with_config.mkdir()
    shutil.copy(llama_dir[0] / "config.json", with_config)
    torch.save(llama_dir[1].state_dict(), with_config / "pytorch_model.bin")
    # ... and a directory holding nothing but the pickle.
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(with_config / "pytorch_model.bin", bare)
    for directory in (with_config, bare):
        message = one_line_error(UnsupportedModelError, lambda d=directory: load_model(d))
        assert "pickle" in message and "safetensors" in message


def test_pickle_checkpoint_file(llama_dir, tmp_path: Path) -> None:
    path = tmp_path / "pytorch_model.bin"
    torch.save(llama_dir[1].state_dict(), path)
    message = one_line_error(UnsupportedModelError, lambda: load_model(path))
    assert "safetensors" in message


def test_nonexistent_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    message = one_line_error(ModelNotFoundError, lambda: load_model(missing))
    assert str(missing) in message


def test_directory_without_config(llama_copy: Path) -> None:
    (llama_copy / "config.json").unlink()
    message = one_line_error(ModelNotFoundError, lambda: load_model(llama_copy))
    assert "config.json" in message


# --------------------------------------------------------------------------- artifact config


def _families() -> list[tuple[str, Callable[[str, Path], object]]]:
    from tiny_deepseek import TINY_DEEPSEEK, make_tiny_deepseek
    from tiny_moe import MOE_ARCHS, make_tiny_moe

    return (
        [(a, make_tiny_model) for a in TINY_ARCHS]
        + [(a, make_tiny_moe) for a in MOE_ARCHS]
        + [(a, make_tiny_deepseek) for a in TINY_DEEPSEEK]
    )


@pytest.mark.parametrize("arch,make", _families(), ids=[a for a, _ in _families()])
def test_model_config_survives_the_artifact_round_trip(arch: str, make, tmp_path: Path) -> None:
    """An artifact stores the ModelConfig the build resolved through transformers and a load
    rebuilds it without transformers: it must come back equal, field by field and type by
    type (a tuple that came back a list, or a dtype a string, would change the model)."""
    from compile_engine.models.config import config_from_dict, config_to_dict
    from compile_engine.models.loader import read_hf_config
    from compile_engine.models.registry import model_class

    make(arch, tmp_path)
    hf = read_hf_config(tmp_path)
    config = model_class(hf.architectures).config_from_hf(hf)
    stored = json.loads(json.dumps(config_to_dict(config)))  # as the manifest holds it
    back = config_from_dict(stored)
    assert type(back) is type(config)
    assert back == config
    for field, value in zip(dataclasses.fields(config), dataclasses.astuple(back), strict=True):
        assert type(value) is type(getattr(config, field.name)), field.name
    # Built from either, the model has the same parameters and buffers.
    from compile_engine.models.loader import open_model

    loaded, _ = open_model(tmp_path, dtype="float32", config=back)
    expected, _ = open_model(tmp_path, dtype="float32")
    assert loaded.hf_config is None
    assert {n: p.shape for n, p in loaded.model.named_parameters()} == {
        n: p.shape for n, p in expected.model.named_parameters()
    }
    for (name, ours), (_, theirs) in zip(
        loaded.model.named_buffers(), expected.model.named_buffers(), strict=True
    ):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=name)


def test_a_config_class_from_elsewhere_is_refused() -> None:
    from compile_engine.models.config import config_from_dict

    for name in ("os.PathLike", "compile_engine.models.loader.LoadedModel"):
        with pytest.raises(ValueError, match="not a model config"):
            config_from_dict({"class": name, "fields": {}})


def test_a_failed_weight_read_on_its_thread_fails_the_engine_start(llama_copy: Path) -> None:
    """The engine reads weights on a thread while it starts; what the read raises must reach
    the caller as the same one-line error a plain load_model gives."""
    from compile_engine import LLM

    name = "model.layers.1.self_attn.k_proj.weight"
    edit_weights(llama_copy, lambda t: t.pop(name))
    message = one_line_error(
        CheckpointError, lambda: LLM(str(llama_copy), target="cpu", enforce_eager=True)
    )
    assert name in message
