"""ModelConfig: the few numbers a model file needs, read once from an HF config."""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field

import torch

from compile_engine.models.errors import UnsupportedModelError

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: dict = field(default_factory=dict)  # HF rope_parameters: rope_type, rope_theta, ...
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    hidden_act: str = "silu"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    checkpoint_dtype: torch.dtype = torch.float32

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def resolve_dtype(name: str | torch.dtype, config: ModelConfig) -> torch.dtype:
    """'auto' keeps the checkpoint's dtype (float32 when it is quantized, e.g. GGUF)."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return config.checkpoint_dtype
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; use auto, float32, bfloat16 or float16")
    return _DTYPES[name]


def _rope_parameters(hf) -> dict:
    rope = getattr(hf, "rope_parameters", None)
    if rope is None:  # transformers 4.x style configs
        rope = dict(getattr(hf, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    rope = dict(rope)
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_type", "default")
    return rope


def config_from_hf(hf, config_cls: type[ModelConfig] = ModelConfig, **overrides) -> ModelConfig:
    """Build a ModelConfig from a transformers PretrainedConfig of a dense decoder.

    A family with more numbers (MoE, MLA) subclasses ModelConfig with defaulted fields and
    passes its class and those values here."""
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {hf.hidden_act!r} is not supported; only silu")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    eos = getattr(hf, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
    # transformers 5 reads a v4 config's "torch_dtype" into `dtype` (and warns on the old name).
    dtype = getattr(hf, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype, torch.float32)
    values = dict(
        architecture=(hf.architectures or ["?"])[0],
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        rope=_rope_parameters(hf),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        sliding_window=getattr(hf, "sliding_window", None),
        eos_token_ids=eos_ids,
        bos_token_id=getattr(hf, "bos_token_id", None),
        checkpoint_dtype=dtype,
    )
    values.update(overrides)
    return config_cls(**values)


# -- a resolved config, stored in an artifact ----------------------------------------------------
# A start from an artifact rebuilds its ModelConfig from what the build resolved instead of
# asking transformers again: transformers' config classes import its modeling stack (their
# docstring decorator loads the auto-model registry), 7 s of the H200's start-up at 3fb7708.
# The artifact's model fingerprint covers config.json, so the stored values cannot go stale.


def _encode(value):
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    return value


def _decode(value):
    if isinstance(value, dict):
        if set(value) == {"__dtype__"}:
            return getattr(torch, value["__dtype__"])
        if set(value) == {"__tuple__"}:
            return tuple(_decode(v) for v in value["__tuple__"])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def config_to_dict(config: ModelConfig) -> dict:
    """JSON-safe form of a ModelConfig (or a family's subclass); `config_from_dict` inverts it
    exactly, dtypes and tuples included."""
    cls = type(config)
    return {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "fields": {f.name: _encode(getattr(config, f.name)) for f in dataclasses.fields(config)},
    }


def config_from_dict(data: dict) -> ModelConfig:
    module_name, _, name = data["class"].rpartition(".")
    if not module_name.startswith(f"{__package__}."):
        raise ValueError(f"{data['class']} is not a model config of this engine")
    cls = getattr(importlib.import_module(module_name), name, None)
    if not (isinstance(cls, type) and issubclass(cls, ModelConfig)):
        raise ValueError(f"{data['class']} is not a model config of this engine")
    return cls(**{k: _decode(v) for k, v in data["fields"].items()})
