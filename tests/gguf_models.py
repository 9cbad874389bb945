"""Tiny quantized GGUF files (issue 29's integer formats) for the model and engine tests."""

from __future__ import annotations

import pathlib

import gguf
import numpy as np
from gguf.quants import quantize

from compile_engine.models import gguf as mg


def permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (HF halves -> adjacent pairs)."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_llama_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named float32 weights of a tied tiny Llama of SHAPE."""
    s = SHAPE
    rng = np.random.default_rng(seed)
    rand = lambda *dims: rng.standard_normal(dims, dtype=np.float32)  # noqa: E731
    q_out, kv_out = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    w = {"model.embed_tokens.weight": rand(s["vocab"], s["hidden"])}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + 0.1 * rand(s["hidden"])
        w[p + "self_attn.q_proj.weight"] = rand(q_out, s["hidden"]) * 0.2
        w[p + "self_attn.k_proj.weight"] = rand(kv_out, s["hidden"]) * 0.2
        w[p + "self_attn.v_proj.weight"] = rand(kv_out, s["hidden"]) * 0.2
        w[p + "self_attn.o_proj.weight"] = rand(s["hidden"], q_out) * 0.2
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rand(s["hidden"])
        w[p + "mlp.gate_proj.weight"] = rand(s["inter"], s["hidden"]) * 0.2
        w[p + "mlp.up_proj.weight"] = rand(s["inter"], s["hidden"]) * 0.2
        w[p + "mlp.down_proj.weight"] = rand(s["hidden"], s["inter"]) * 0.2
    w["model.norm.weight"] = 1 + 0.1 * rand(s["hidden"])
    return w


# int4pack_cpu packs rows in blocks of 64 (32 under AVX2) and every format groups 32 columns:
# shapes to fit.
SHAPE = dict(vocab=64, hidden=64, inter=128, layers=2, heads=4, kv_heads=4, head_dim=16)


def write_quantized_gguf(
    path: pathlib.Path, weights: dict[str, np.ndarray], proj: str, embd: str = "Q8_0"
) -> pathlib.Path:
    """HF-named float weights as a GGUF file with projections in `proj` and token_embd in
    `embd` (norms F32), llama.cpp's names and Q/K row order."""
    s = SHAPE
    to_gguf = {v: k for k, v in mg._LLAMA_GLOBAL_TENSORS.items()}
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(s["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["inter"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_dimension_count(s["head_dim"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    # a SentencePiece-style vocabulary, so that the engine has a tokenizer
    tokens = ["<unk>", "<s>", "</s>"] + [f"\u2581t{i}" for i in range(s["vocab"] - 3)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    for name, w in weights.items():
        if name.startswith("model.layers."):
            i, suffix = name.removeprefix("model.layers.").split(".", 1)
            gname = next(f"blk.{i}.{g}" for g, h in mg._LLAMA_LAYER_TENSORS.items() if h == suffix)
        else:
            gname = to_gguf[name]
        if name.endswith("q_proj.weight") or name.endswith("k_proj.weight"):
            w = permute_like_llama_cpp(w, s["heads"])
        kind = proj if name.endswith("_proj.weight") else embd if "embed" in name else "F32"
        if kind == "F32":
            writer.add_tensor(gname, np.ascontiguousarray(w))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(gname, quantize(np.ascontiguousarray(w), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
