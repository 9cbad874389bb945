"""GGUF checkpoints as a source of (HF config, HF-named tensors).

A GGUF file carries llama.cpp's names, its metadata keys and, for Llama, Q and K projections in
llama.cpp's rotary row order. This module translates all three so that the common loader sees
exactly what an HF safetensors directory would give it: a `PretrainedConfig` and tensors named
`model.layers.{i}.self_attn.q_proj.weight` etc. in HF's [out, in] layout and HF's rotary order.
`tensors()` dequantizes quantized tensors to float32 (then casts); `quantized_tensors()` reads
the blocks of the types the quant_linear path runs (QUANTIZED_TYPES) straight from the file as
codes and scales, without dequantizing (models/quant.py's integer formats, group 32).

It imports nothing from `models/` but its errors and aliases, so it can be tested alone.
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import transformers
from gguf import GGUFReader
from gguf.quants import dequantize

from compile_engine.models.errors import ModelNotFoundError, UnsupportedModelError
from compile_engine.models.gguf_alias import SMOLLM2_ALIAS, resolve_alias

__all__ = ["SMOLLM2_ALIAS", "GGUFCheckpoint", "resolve_alias"]

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama",)

# llama.cpp per-layer tensor name (after "blk.{i}.") -> HF name (after "model.layers.{i}.")
_LLAMA_LAYER_TENSORS: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LLAMA_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Llama 3.1-style rope scaling is stored as a per-frequency divisor table, not as metadata;
# hf_config() turns it back into rope_parameters, so it is not a weight.
_ROPE_FREQS = "rope_freqs.weight"

_MISSING: Any = object()

# GGUF block types read as codes + scales, and the models/quant.py weight format and group each
# is: Q4_0 w = d (q - 8), Q4_1 w = d q + m, Q8_0 w = d q (groups of 32); Q5_0 w = d (q - 16)
# as int8 codes q - 16, Q5_1 w = d q + m (uint8), Q4_K / Q5_K w = (d sc) q - (dmin m) per
# 32-column sub-block (uint4 / uint8 with the offset -(dmin m)), Q6_K w = (d sc) (q - 32) per
# 16-column sub-block (int8 codes q - 32). Each scale and offset is the product gguf's
# dequantize forms, so `dequantize_int_ref` of them is gguf.quants.dequantize bit for bit.
BLOCK_TYPES: dict[str, tuple[str, int]] = {
    "Q4_0": ("int4", 32),
    "Q4_1": ("uint4", 32),
    "Q8_0": ("int8", 32),
    "Q5_0": ("int8", 32),
    "Q5_1": ("uint8", 32),
    "Q4_K": ("uint4", 32),
    "Q5_K": ("uint8", 32),
    "Q6_K": ("int8", 16),
}
# The types the quantized path keeps quantized in memory (quantized_tensors): the rest of
# BLOCK_TYPES are read by read_blocks and dequantized at load (`tensors`), no CPU kernel takes
# them yet, and one model runs one scheme (a Q4_K_M file mixes Q4_K and Q6_K).
QUANTIZED_TYPES: dict[str, str] = {"Q4_0": "int4", "Q4_1": "uint4", "Q8_0": "int8"}
# Kept as float tensors either way.
FLOAT_TYPES = ("F32", "F16", "BF16")
GGUF_GROUP = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144,
               "Q5_K": 176, "Q6_K": 210}  # fmt: skip


def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float32 of the float16 they hold."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 scale bytes [B, 12] -> the 8 sub-blocks' 6-bit scales and mins
    [B, 8]: bytes 0-3 scales 0-3 (low 6 bits), 4-7 mins 0-3; bytes 8-11 the low / high nibbles
    of scales / mins 4-7, whose top two bits sit in bytes 0-3 / 4-7's top bits."""
    d, m, md = raw[:, 0:4], raw[:, 4:8], raw[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """[B, n * width] bytes -> [B, 2 n, width]: each run of `width` bytes as its low nibbles'
    elements, then its high nibbles'."""
    runs = qs.reshape(qs.shape[0], -1, 1, width)
    return np.concatenate([runs & 15, runs >> 4], axis=2).reshape(qs.shape[0], -1, width)


def read_blocks(data: np.ndarray, type_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized tensor's raw blocks ([rows, bytes a row] uint8) -> (codes [rows, K]: int8
    for the int8 formats, else uint8; scales float32 [rows, G], or [rows, G, 2] = (s, m) for
    the uint formats), G = K / BLOCK_TYPES' group."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(-1, BLOCK_BYTES[type_name])  # [B, bytes]
    n = blocks.shape[0]
    m = None
    if type_name in ("Q4_0", "Q4_1", "Q8_0"):
        head = 4 if type_name == "Q4_1" else 2
        d = _f16(blocks[:, 0:2])[:, None]  # [B, 1]
        if type_name == "Q4_1":
            m = _f16(blocks[:, 2:4])[:, None]
        qs = blocks[:, head:]
        if type_name == "Q8_0":
            codes = qs.view(np.int8)
        else:  # a block's byte j holds element j (low nibble) and element j + 16 (high)
            codes = np.concatenate([qs & 15, qs >> 4], axis=-1)
    elif type_name in ("Q5_0", "Q5_1"):
        head = 4 if type_name == "Q5_1" else 2
        d = _f16(blocks[:, 0:2])[:, None]
        if type_name == "Q5_1":
            m = _f16(blocks[:, 2:4])[:, None]
        qh = np.ascontiguousarray(blocks[:, head : head + 4]).view(np.uint32)  # [B, 1]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [B, 32]
        qs = blocks[:, head + 4 :]
        codes = np.concatenate([qs & 15, qs >> 4], axis=-1) | (high << 4)
        if type_name == "Q5_0":
            codes = codes.astype(np.int8) - np.int8(16)
    elif type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks[:, 0:2])[:, None], _f16(blocks[:, 2:4])[:, None]
        sc, mn = _k_scales(blocks[:, 4:16])
        d, m = d * sc, -(dmin * mn)  # [B, 8] each: the sub-blocks' scale and offset
        if type_name == "Q4_K":
            codes = _nibbles(blocks[:, 16:], 32).reshape(n, 256)
        else:
            qh = blocks[:, 16:48]  # [B, 32]: bit i of byte j is sub-block i's element j
            high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
            codes = (_nibbles(blocks[:, 48:], 32) | (high << 4)).reshape(n, 256)
    elif type_name == "Q6_K":
        ql, qh = blocks[:, 0:128], blocks[:, 128:192]
        scales = blocks[:, 192:208].view(np.int8).astype(np.float32)  # [B, 16]
        d = _f16(blocks[:, 208:210])[:, None] * scales  # [B, 16]
        low = _nibbles(ql, 64).reshape(n, 8, 32)
        # qh: each run of 32 bytes holds four 32-element sub-runs, two bits each
        runs = (
            qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
        )
        high = (runs & 3).reshape(n, 8, 32)
        codes = ((low | (high << 4)).astype(np.int8) - np.int8(32)).reshape(n, 256)
    else:
        raise UnsupportedModelError(f"GGUF type {type_name} is not read as blocks")
    codes = codes.reshape(rows, -1)
    groups = codes.shape[1] // BLOCK_TYPES[type_name][1]
    scale = d.reshape(rows, groups)
    if m is not None:
        scale = np.stack([scale, m.reshape(rows, groups)], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(
        np.ascontiguousarray(scale, dtype=np.float32)
    )


def unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of a Q or K weight ([n_head * head_dim, in]).

    llama.cpp rotates adjacent pairs (x0, x1), HF rotates halves (x0, x_{d/2}); its converter
    stores rows as reshape(n_head, 2, d/2, in).swapaxes(1, 2). This is the inverse.
    """
    out_features = w.shape[0]
    head_dim = out_features // n_head
    # [n_head, d/2, 2, in] -> [n_head, 2, d/2, in] -> [n_head * d, in]
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _llama3_rope_factors(
    theta: float, head_dim: int, factor: float, low: float, high: float, original_ctx: int
) -> np.ndarray:
    """The divisor per rotary frequency that llama.cpp's converter writes for rope_type llama3."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_ctx / wavelen - low) / (high - low)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < original_ctx / high, 1.0, blended)
    return np.where(wavelen > original_ctx / low, factor, out)


class GGUFCheckpoint:
    """A memory-mapped GGUF file read as an HF config plus HF-named tensors."""

    def __init__(self, path: str | pathlib.Path) -> None:
        self.path = pathlib.Path(path)
        if not self.path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {self.path}")
        self._reader = GGUFReader(self.path)
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.architecture: str = self._field("general.architecture")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{self.path.name}: GGUF architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

    def _field(self, key: str, default: Any = _MISSING) -> Any:
        field = self._reader.get_field(key)
        if field is None:
            if default is _MISSING:
                raise UnsupportedModelError(f"{self.path.name}: GGUF metadata lacks {key!r}")
            return default
        return field.contents()

    def _arch_field(self, suffix: str, default: Any = _MISSING) -> Any:
        return self._field(f"{self.architecture}.{suffix}", default)

    @property
    def chat_template(self) -> str | None:
        return self._field("tokenizer.chat_template", None)

    def hf_config(self) -> transformers.PretrainedConfig:
        hidden = int(self._arch_field("embedding_length"))
        heads = int(self._arch_field("attention.head_count"))
        kv_heads = self._arch_field("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):
            raise UnsupportedModelError(
                f"{self.path.name}: per-layer KV head counts are not supported for llama"
            )
        head_dim = self._arch_field("attention.key_length", None)
        if head_dim is None:
            head_dim = self._arch_field("rope.dimension_count", hidden // heads)
        embd = self._tensors.get("token_embd.weight")
        if embd is not None:
            vocab = int(embd.shape[1])  # GGUF shapes are [in, out]: [hidden, vocab]
        else:
            vocab = len(self._field("tokenizer.ggml.tokens"))
        theta = float(self._arch_field("rope.freq_base", 10000.0))
        return transformers.LlamaConfig(
            architectures=["LlamaForCausalLM"],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(self._arch_field("feed_forward_length")),
            num_hidden_layers=int(self._arch_field("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(self._arch_field("attention.layer_norm_rms_epsilon")),
            max_position_embeddings=int(self._arch_field("context_length")),
            rope_parameters=self._rope_parameters(theta, int(head_dim)),
            tie_word_embeddings="output.weight" not in self._tensors,
            bos_token_id=self._field("tokenizer.ggml.bos_token_id", None),
            eos_token_id=self._field("tokenizer.ggml.eos_token_id", None),
            pad_token_id=self._field("tokenizer.ggml.padding_token_id", None),
        )

    def _rope_parameters(self, theta: float, head_dim: int) -> dict[str, Any]:
        params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
        kind = self._arch_field("rope.scaling.type", None)
        factor = self._arch_field("rope.scaling.factor", None)
        if kind is None and self._arch_field("rope.scale_linear", None) is not None:
            # files from before rope.scaling.* existed
            kind, factor = "linear", self._arch_field("rope.scale_linear")
        if kind in ("linear", "yarn"):
            params.update(rope_type=kind, factor=float(factor))
            original = self._arch_field("rope.scaling.original_context_length", None)
            if kind == "yarn" and original is not None:
                params["original_max_position_embeddings"] = int(original)
            attn_factor = self._arch_field("rope.scaling.attn_factor", None)
            if kind == "yarn" and attn_factor is not None:
                params["attention_factor"] = float(attn_factor)
        elif kind not in (None, "none"):
            raise UnsupportedModelError(
                f"{self.path.name}: rope scaling type {kind!r} is not supported; "
                "supported: none, linear, yarn, llama3 (rope_freqs table)"
            )
        if _ROPE_FREQS in self._tensors:
            if params["rope_type"] != "default":
                raise UnsupportedModelError(
                    f"{self.path.name}: both rope scaling metadata and {_ROPE_FREQS}"
                )
            params.update(self._llama3_from_table(theta, head_dim))
        return params

    def _llama3_from_table(self, theta: float, head_dim: int) -> dict[str, Any]:
        """Recover llama3 rope_parameters from the divisor table llama.cpp stores.

        The table loses the parameters, so try the ones every Llama 3.x release uses (low 1,
        high 4, factor = the largest divisor) over plausible original contexts, and accept only
        an exact reproduction.
        """
        t = self._tensors[_ROPE_FREQS]
        table = dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)
        # release factors are round numbers; a table rebuilt from float32 inverse frequencies
        # carries ~1e-7 noise that must not leak into the config
        factor = round(float(table.max()), 4)
        for original in (8192, 4096, 2048, 16384, 32768, 65536, 131072):
            expect = _llama3_rope_factors(theta, head_dim, factor, 1.0, 4.0, original)
            if expect.shape == table.shape and np.allclose(table, expect, rtol=1e-5, atol=0):
                return {
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": original,
                }
        raise UnsupportedModelError(
            f"{self.path.name}: {_ROPE_FREQS} matches no llama3 rope scaling this loader "
            "recognises; load the HF safetensors checkpoint instead"
        )

    def _hf_name(self, name: str) -> str | None:
        """HF name of a GGUF tensor, None for tensors folded into the config."""
        if name == _ROPE_FREQS:
            return None
        if name in _LLAMA_GLOBAL_TENSORS:
            return _LLAMA_GLOBAL_TENSORS[name]
        prefix, _, rest = name.partition(".")
        layer, _, suffix = rest.partition(".")
        if prefix == "blk" and layer.isdigit() and suffix in _LLAMA_LAYER_TENSORS:
            return f"model.layers.{int(layer)}.{_LLAMA_LAYER_TENSORS[suffix]}"
        raise UnsupportedModelError(
            f"{self.path.name}: unknown tensor {name!r} for GGUF architecture {self.architecture!r}"
        )

    def tensors(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, tensor) in file order, dequantized to float32 then cast to dtype.

        Every name is checked before the first dequantization, so a bad file fails fast.
        """
        names = {t.name: self._hf_name(t.name) for t in self._reader.tensors}
        heads = int(self._arch_field("attention.head_count"))
        kv_heads = int(self._arch_field("attention.head_count_kv", heads))
        for t in self._reader.tensors:
            hf_name = names[t.name]
            if hf_name is None:
                continue
            # numpy rows are GGUF's reversed shape, i.e. already HF's [out, in]
            array = dequantize(t.data, t.tensor_type)
            if not array.flags.writeable:
                # F32 tensors come back as a view of the read-only memory map
                array = np.array(array)
            w = torch.from_numpy(array)
            if hf_name.endswith("q_proj.weight"):
                w = unpermute_rotary(w, heads)
            elif hf_name.endswith("k_proj.weight"):
                w = unpermute_rotary(w, kv_heads)
            yield hf_name, w.to(dtype)

    def tensor_types(self) -> dict[str, str]:
        """HF name -> GGUF type name ("Q4_1", "F32", ...) of every tensor the model loads."""
        names = {t.name: self._hf_name(t.name) for t in self._reader.tensors}
        return {names[t.name]: t.tensor_type.name for t in self._reader.tensors if names[t.name]}

    def quantized_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, tensor) in file order with QUANTIZED_TYPES kept quantized: `name` the
        codes and `name` with `_scale` for `weight`'s suffix the scales (read_blocks), Q and K
        rows un-permuted like `tensors()`'s; float tensors as float32. Any other type is an
        UnsupportedModelError that names it."""
        heads = int(self._arch_field("attention.head_count"))
        kv_heads = int(self._arch_field("attention.head_count_kv", heads))
        types = self.tensor_types()
        for name, kind in types.items():
            if kind not in QUANTIZED_TYPES and kind not in FLOAT_TYPES:
                raise UnsupportedModelError(
                    f"{self.path.name}: tensor {name} is {kind}; the quantized path reads "
                    f"{', '.join(QUANTIZED_TYPES)} (and float) tensors; use --dtype float32 to "
                    "run this file dequantized"
                )
        for t in self._reader.tensors:
            hf_name = self._hf_name(t.name)
            if hf_name is None:
                continue
            kind = t.tensor_type.name
            # an untied lm_head is a plain Linear (it runs outside the compiled graph)
            if kind not in QUANTIZED_TYPES or hf_name == "lm_head.weight":
                yield hf_name, torch.from_numpy(np.array(dequantize(t.data, t.tensor_type)))
                continue
            codes, scales = read_blocks(t.data, kind)
            n_head = None
            if hf_name.endswith("q_proj.weight"):
                n_head = heads
            elif hf_name.endswith("k_proj.weight"):
                n_head = kv_heads
            if n_head is not None:
                codes, scales = unpermute_rotary(codes, n_head), unpermute_rotary(scales, n_head)
            yield hf_name, codes
            yield hf_name.removesuffix("weight") + "weight_scale", scales

    def tokenizer(self) -> transformers.PreTrainedTokenizerBase:
        """transformers' tokenizer rebuilt from the GGUF vocabulary (takes a few seconds)."""
        return transformers.AutoTokenizer.from_pretrained(
            str(self.path.parent), gguf_file=self.path.name
        )
