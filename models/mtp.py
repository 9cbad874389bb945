"""DeepSeek-V3's multi-token prediction (MTP) module, a draft head stored in the target's own
checkpoint: `num_nextn_predict_layers` extra decoder layers after the last one (layer index
num_hidden_layers, model.layers.61.* for V3's 61 layers), as the V3 report describes and vLLM
and SGLang run it.

At position p it sees the token after p and the target's final hidden state at p (after the
model's final norm), and predicts the token after that:

    x      = eh_proj([enorm(embed(t[p+1])) | hnorm(h_p)])   # [T, 2H] -> [T, H]
    out    = decoder_layer(x)                               # MLA + MoE as the model's, prenorm
    logits = lm_head(shared_head.norm(out))                 # [T, V]

The next draft step feeds `out` in place of h. The embedding at position 0 is zeroed (vLLM's
rule: the MTP was trained never to read it). The layer's `embed_tokens` and `shared_head.head`
are copies of the model's own (the report shares them): we use the model's and skip the copies
(1.8 GB at V3's size). With more than one MTP layer, the first drafts every step (vLLM runs
layer step % n; the published V3 and R1 have one).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import Tensor, nn

from compile_engine.models.deepseek import (
    EXPERT_SHARDS,
    DeepseekConfig,
    DeepseekDecoderLayer,
    DeepseekV2ForCausalLM,
)
from compile_engine.models.errors import CheckpointError, UnsupportedModelError
from compile_engine.models.layers import AttentionMetadata, Linear, RMSNorm, RotaryEmbedding


class SharedHead(nn.Module):
    """The MTP layer's own final norm; its `head` is the model's lm_head."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)


class DeepseekMTP(DeepseekDecoderLayer):
    """One MTP layer: a DeepSeek decoder layer (its parameter names: the checkpoint's after
    `model.layers.<L>.`) with the input norms and projection in front of it."""

    packed_modules = DeepseekV2ForCausalLM.packed_modules
    stacked_modules = EXPERT_SHARDS
    checkpoint_renames = DeepseekV2ForCausalLM.checkpoint_renames

    def __init__(self, config: DeepseekConfig, max_positions: int) -> None:
        """config: the target's, with num_layers 1 and sparse_layers (0,) when the MTP layer
        is MoE (`mtp_config`)."""
        rotary_emb = RotaryEmbedding(config.rope, config.qk_rope_head_dim, max_positions)
        super().__init__(config, 0, rotary_emb)
        self.config = config
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = Linear(2 * hidden, hidden)
        self.shared_head = SharedHead(hidden, config.rms_norm_eps)

    def skip_checkpoint_tensor(self, name: str) -> bool:
        return name in ("embed_tokens.weight", "shared_head.head.weight")  # the model's own

    @property
    def feature_size(self) -> int:
        return 0  # reads the target's final hidden state itself, not extra aux states

    def fuse(self, features: Tensor) -> Tensor:
        return features

    def forward(
        self,
        embeds: Tensor,
        positions: Tensor,
        hidden: Tensor,
        kv_caches: list[Tensor],
        meta: AttentionMetadata,
    ) -> Tensor:
        """embeds [T, H] of the tokens after each position, hidden [T, H] (the target's final
        hidden states, or the previous step's output) -> the output before the norm [T, H]."""
        embeds = torch.where((positions == 0).unsqueeze(-1), 0.0, embeds)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        out, residual = DeepseekDecoderLayer.forward(self, positions, x, None, kv_caches[0], meta)
        return out + residual

    def compute_logits(self, out: Tensor, target_lm_head) -> Tensor:
        """out [S, H] -> logits [S, V] through the model's own lm_head."""
        return target_lm_head(self.shared_head.norm(out))

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        cfg = self.config
        return (num_blocks, block_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def mtp_config(target: DeepseekConfig, hf_raw: dict) -> DeepseekConfig:
    """The MTP layer's config: the target's, one layer, MoE when its index (num_layers) is
    past first_k_dense_replace and the model has routed experts (as every V3 layer there)."""
    index = target.num_layers
    sparse = bool(target.num_experts) and index >= int(hf_raw.get("first_k_dense_replace") or 0)
    return dataclasses.replace(target, num_layers=1, sparse_layers=(0,) if sparse else ())


def load_mtp_head(
    directory: str | Path,
    target: DeepseekConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int,
):
    """The first MTP layer of the DeepSeek checkpoint in `directory` (the target's), as a
    LoadedModel whose config is the one-layer `mtp_config`."""
    from compile_engine.models.loader import (
        LoadedModel,
        ModelSource,
        _iter_safetensors,
        _safetensors_files,
        load_weights,
        materialize,
    )

    directory = Path(directory)
    raw = json.loads((directory / "config.json").read_text())
    if not isinstance(target, DeepseekConfig) or "DeepseekV3ForCausalLM" not in (
        raw.get("architectures") or ()
    ):
        raise UnsupportedModelError(
            "method 'mtp' runs DeepSeek-V3's multi-token prediction layers; the target "
            f"{directory} is {raw.get('architectures')}"
        )
    if not int(raw.get("num_nextn_predict_layers") or 0):
        raise CheckpointError(
            f"{directory}/config.json has no num_nextn_predict_layers: the checkpoint carries "
            "no MTP layer for method 'mtp'"
        )
    config = mtp_config(target, raw)
    prefix = f"model.layers.{target.num_layers}."
    with torch.device("meta"):
        head = DeepseekMTP(config, max_positions)
    head = head.to(dtype=dtype).eval().requires_grad_(False)
    materialize(head, device)
    # Only the MTP layer's slices are read (lazily), not the model's other weights.
    tensors = (
        (name.removeprefix(prefix), lazy.read())
        for name, lazy in _iter_safetensors(_safetensors_files(directory), lazy=True)
        if name.startswith(prefix)
    )
    try:
        load_weights(head, tensors)
    except CheckpointError as exc:
        raise CheckpointError(f"the MTP layer {prefix}*: {exc}") from None
    return LoadedModel(head, config, None, ModelSource(directory, "hf"), dtype)
