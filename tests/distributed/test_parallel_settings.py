"""Tensor-parallel settings, checks and sharding rules that need no process group: the config's
validation, the flags, which KV heads a rank keeps, the errors of a model that does not split,
an artifact served with another rank count, the torchrun launch, the slices a rank reads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from compile_engine.cli import build_parser
from compile_engine.compiler.artifact import Manifest
from compile_engine.models.config import ModelConfig
from compile_engine.models.errors import UnsupportedModelError
from compile_engine.models.loader import build_on_meta
from compile_engine.models.parallel import TensorParallel, kv_heads_of
from compile_engine.runtime.builder import check_parallel_matches
from compile_engine.runtime.engine_args import engine_kwargs
from compile_engine.runtime.engine_config import EngineConfig, EngineConfigError
from compile_engine.runtime.parallel import TensorParallelError, torchrun_launch

LLAMA = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    max_position_embeddings=64,
    rope={"rope_type": "default", "rope_theta": 10000.0},
)


def _rank(rank: int, world: int, expert: bool = False) -> TensorParallel:
    return TensorParallel(rank, world, "unused", expert)  # shapes only: no group needed


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(tensor_parallel_size=0), "tensor_parallel_size=0 is invalid"),
        (dict(tensor_parallel_size=True), "tensor_parallel_size=True is invalid"),
        (dict(enable_expert_parallel=True), "enable_expert_parallel needs tensor_parallel"),
        (dict(distributed_timeout_s=0), "distributed_timeout_s=0 is invalid"),
    ],
)
def test_invalid_settings_are_named(settings, message):
    with pytest.raises(EngineConfigError, match=message):
        EngineConfig(model="m", target="cpu", **settings)


def test_flags_are_vllms():
    parser = build_parser()
    args = parser.parse_args(["serve", "m", "--tensor-parallel-size", "4"])
    assert engine_kwargs(args)["tensor_parallel_size"] == 4
    args = parser.parse_args(["serve", "m", "-tp", "2", "--enable-expert-parallel"])
    kwargs = engine_kwargs(args)
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["enable_expert_parallel"]
    build = parser.parse_args(["build", "m", "--tensor-parallel-size", "2"])
    assert build.tensor_parallel_size == 2


def test_kv_heads_split_or_replicate():
    # 8 query heads over 2 KV heads: 2 ranks split the KV heads, 4 and 8 replicate them.
    assert [kv_heads_of(8, 2, _rank(r, 2)) for r in range(2)] == [(0, 1), (1, 1)]
    assert [kv_heads_of(8, 2, _rank(r, 4)) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [kv_heads_of(8, 2, _rank(r, 8))[0] for r in range(8)] == [0] * 4 + [1] * 4
    assert [kv_heads_of(8, 4, _rank(r, 2)) for r in range(2)] == [(0, 2), (2, 2)]


def test_a_rank_allocates_only_its_kv_heads():
    model = build_on_meta(LLAMA, torch.float32, parallel=_rank(1, 4))
    assert model.kv_cache_shape(8, 16) == (2, 8, 16, 1, 16)  # 2 KV heads over 4 ranks
    attn = model.model.layers[0].self_attn
    assert attn.num_heads == 1 and attn.qkv_proj.weight.shape == (3 * 16, 64)
    assert model.lm_head.weight.shape == (24, 64)  # a quarter of the vocabulary


def test_a_padded_vocabulary():
    config = dataclasses.replace(LLAMA, vocab_size=95)
    heads = [build_on_meta(config, torch.float32, parallel=_rank(r, 2)).lm_head for r in (0, 1)]
    assert [h.span for h in heads] == [(0, 48), (48, 96)]  # the last row is padding


@pytest.mark.parametrize(
    ("change", "world", "expert", "message"),
    [
        (dict(), 3, False, "tensor_parallel_size=3 does not divide num_attention_heads=4"),
        (dict(num_heads=6, num_kv_heads=3), 2, False, "num_key_value_heads=3"),
        (dict(intermediate_size=90), 4, False, "does not divide intermediate_size=90"),
        (dict(), 2, True, "enable_expert_parallel needs a MoE model"),
    ],
)
def test_a_model_that_does_not_split_is_refused(change, world, expert, message):
    config = dataclasses.replace(LLAMA, **change)
    with pytest.raises(UnsupportedModelError, match=message):
        build_on_meta(config, torch.float32, parallel=_rank(0, world, expert))


def _manifest(**engine_args) -> Manifest:
    return Manifest(
        model_path="/models/m",
        model_kind="hf",
        model_fingerprint="f",
        architecture="LlamaForCausalLM",
        dtype="float32",
        target="cpu",
        device="cpu:x86_64",
        code_hash="c",
        versions={},
        engine_args=engine_args,
        passes=[],
        pass_manager_uuid="u",
        compile={},
        kernels=[],
        timings={},
    )


def test_an_artifact_serves_only_the_rank_count_it_was_built_for(tmp_path):
    config = EngineConfig(model="m", target="cpu")
    check_parallel_matches(_manifest(), tmp_path, config)  # older artifacts: one rank
    with pytest.raises(EngineConfigError) as raised:
        check_parallel_matches(_manifest(tensor_parallel_size=2), tmp_path, config)
    message = str(raised.value)
    assert "built for tensor_parallel_size=2, not tensor_parallel_size=1" in message
    assert "--tensor-parallel-size 1 --out" in message
    assert _manifest(tensor_parallel_size=2).rebuild_hint(tmp_path).count("--tensor-parallel") == 1
    ep = EngineConfig(model="m", target="cpu", tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(EngineConfigError, match="expert parallel"):
        check_parallel_matches(_manifest(tensor_parallel_size=2), tmp_path, ep)


def test_torchrun_launch(monkeypatch):
    for name in ("RANK", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    assert torchrun_launch(2, "gloo") is None
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    launch = torchrun_launch(2, "gloo")
    assert (launch.rank, launch.world_size, launch.init_method) == (1, 2, "env://")
    with pytest.raises(TensorParallelError, match="WORLD_SIZE=2 but tensor_parallel_size=4"):
        torchrun_launch(4, "gloo")


class _Recording:
    """A checkpoint slice source that records what the loader asked of it."""

    def __init__(self, tensor: torch.Tensor, asked: list) -> None:
        self.tensor, self.asked = tensor, asked

    def __getitem__(self, index):
        self.asked.append(index)
        return self.tensor[index]


def test_a_rank_reads_only_its_slices_of_each_tensor():
    """Rank 1 of 2 asks each sharded tensor for its rows or columns only; replicated tensors
    (the norms) are read whole."""
    from compile_engine.models.layers import FusedLinear, LazyTensor
    from compile_engine.models.loader import export_hf_checkpoint, load_weights, materialize

    full = build_on_meta(LLAMA, torch.float32)
    materialize(full, "cpu")
    with torch.no_grad():
        for p in full.parameters():
            p.normal_()
    shard = build_on_meta(LLAMA, torch.float32, parallel=_rank(1, 2))
    materialize(shard, "cpu")
    asked: dict[str, list] = {}
    checkpoint = {}
    for module_name, module in full.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{pname}"
            if isinstance(module, FusedLinear):  # the checkpoint's q/k/v, gate/up again
                parent = module_name.rpartition(".")[0]
                for proj, (a, b) in module.offsets.items():
                    checkpoint[f"{parent}.{proj}.{pname}"] = param[a:b]
            else:
                checkpoint[name] = param
    lazy = []
    for name, tensor in checkpoint.items():
        asked[name] = []
        lazy.append((name, LazyTensor(_Recording(tensor, asked[name]), tuple(tensor.shape))))
    load_weights(shard, lazy)
    assert asked["model.layers.0.self_attn.q_proj.weight"] == [(slice(32, 64),)]
    assert asked["model.layers.0.self_attn.k_proj.weight"] == [(slice(16, 32),)]
    assert asked["model.layers.0.self_attn.o_proj.weight"] == [(slice(None), slice(32, 64))]
    assert asked["model.layers.0.mlp.down_proj.weight"] == [(slice(None), slice(48, 96))]
    assert asked["model.embed_tokens.weight"] == [(slice(48, 96),)]
    assert asked["model.norm.weight"] == [(slice(None),)]
    assert asked["lm_head.weight"] == [(slice(48, 96),)]
    q = shard.model.layers[0].self_attn.qkv_proj.weight[:32]
    assert torch.equal(q, checkpoint["model.layers.0.self_attn.q_proj.weight"][32:64])
    with pytest.raises(ValueError, match="cannot be exported"):
        export_hf_checkpoint(shard, None, "unused")
