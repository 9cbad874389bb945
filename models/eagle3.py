"""EAGLE-3 draft heads (Li et al., 2025) in the layout published for Llama-3.1-8B
(yuhuili/EAGLE3-LLaMA3.1-Instruct-8B), which vLLM and SGLang load as `LlamaForCausalLMEagle3`.

A head is one Llama decoder layer that reads the target's own hidden states: at position p it
sees the token after p and the target's residual stream at three depths (low, middle, high),
and predicts the token after that:

    g      = fc([a_low | a_mid | a_high])                    # [T, 3 Ht] -> [T, H], target at p
    x      = [input_layernorm(embed(t[p+1])) | hidden_norm(g)]   # [T, 2H]: qkv reads both
    h      = o_proj(attention(x)) + g                        # the residual is g
    out    = mlp(post_attention_layernorm(h)) + h            # [T, H], fed to the next step
    logits = lm_head(norm(out))                              # [T, draft_vocab] -> target ids

The next draft step feeds its own `out` in place of g (H wide: no fc). The aux states are the
inputs of target layers `eagle_aux_hidden_state_layer_ids` (vLLM's convention: id j is the
residual stream entering layer j, id num_layers the last layer's output before the final norm;
default (2, L // 2, L - 3), vLLM's for Llama, clamped into [0, L]).

Checkpoint: config.json (architectures ["LlamaForCausalLMEagle3"], model_type llama,
num_hidden_layers 1, draft_vocab_size, optional target_hidden_size, norm_before_residual and
eagle_aux_hidden_state_layer_ids, at the top level or in eagle_config) and tensors `fc`,
`midlayer.*` (q/k/v_proj read 2H), `norm`, `lm_head` [draft_vocab, H], `d2t` [draft_vocab]
(target id = draft id + d2t[draft id]), `t2d` [V] (the inverse as a mask; unused), and
`embed_tokens` only in some exports: without it the head shares the target's embedding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from compile_engine.models.config import ModelConfig, config_from_hf
from compile_engine.models.errors import CheckpointError, UnsupportedModelError
from compile_engine.models.layers import (
    Attention,
    AttentionMetadata,
    Embedding,
    FusedLinear,
    GatedMLP,
    Linear,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
    _copy_checked,
)
from compile_engine.models.llama import LlamaForCausalLM

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    model: ModelConfig  # the decoder layer's shapes (num_layers 1)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, int, int]
    norm_before_residual: bool = False


def read_eagle3_config(directory: Path, target: ModelConfig) -> Eagle3Config:
    """The head's config, checked against the target it drafts for."""
    import transformers

    raw = json.loads((directory / "config.json").read_text())
    if not set(raw.get("architectures") or ()) & set(ARCHITECTURES):
        raise UnsupportedModelError(
            f"{directory} is not an EAGLE-3 head (architectures {raw.get('architectures')}); "
            f"method 'eagle3' needs one of {', '.join(ARCHITECTURES)}"
        )
    hf = transformers.LlamaConfig.from_dict({k: v for k, v in raw.items() if k != "architectures"})
    hf.architectures = [ARCHITECTURES[0]]
    model = config_from_hf(hf, qkv_bias=bool(raw.get("attention_bias", False)))
    if model.num_layers != 1:
        raise UnsupportedModelError(
            f"an EAGLE-3 head of {model.num_layers} layers is not supported (the published "
            "heads have one)"
        )
    if model.vocab_size != target.vocab_size:
        raise CheckpointError(
            f"the EAGLE-3 head's vocabulary is {model.vocab_size} tokens, the target's "
            f"{target.vocab_size}; a head drafts for the target it was trained on"
        )
    target_hidden = int(raw.get("target_hidden_size") or model.hidden_size)
    if target_hidden != target.hidden_size:
        raise CheckpointError(
            f"the EAGLE-3 head reads hidden states of width {target_hidden}, the target's are "
            f"{target.hidden_size}"
        )
    eagle = raw.get("eagle_config") or {}
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    layers = target.num_layers
    if not ids:
        # vLLM's default for Llama, clamped into a target shallower than five layers.
        ids = tuple(max(0, min(layers, i)) for i in (2, layers // 2, layers - 3))
    ids = tuple(ids)
    if len(ids) != 3 or not all(0 <= i <= layers for i in ids):
        raise CheckpointError(
            f"eagle_aux_hidden_state_layer_ids {list(ids)}: three ids in [0, {layers}] "
            "(layer inputs of the target) are needed"
        )
    return Eagle3Config(
        model=model,
        draft_vocab_size=int(raw.get("draft_vocab_size") or model.vocab_size),
        target_hidden_size=target_hidden,
        aux_layer_ids=ids,
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
    )


class Eagle3DecoderLayer(nn.Module):
    """The Llama layer with qkv over [embeds | hidden] and the hidden input as its residual."""

    def __init__(self, config: Eagle3Config, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        cfg = config.model
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary_emb)
        attn = self.self_attn
        attn.qkv_proj = FusedLinear(
            2 * cfg.hidden_size,
            {"q_proj": attn.q_size, "k_proj": attn.kv_size, "v_proj": attn.kv_size},
            bias=cfg.qkv_bias,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg)

    def forward(
        self,
        positions: Tensor,
        embeds: Tensor,
        hidden: Tensor,
        kv_cache: Tensor,
        meta: AttentionMetadata,
    ) -> tuple[Tensor, Tensor]:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [T, 2H]
        out = self.self_attn(positions, x, kv_cache, meta)  # [T, H]
        out, residual = self.post_attention_layernorm(out, residual)
        return self.mlp(out), residual


class Eagle3Head(nn.Module):
    """The head over a packed batch, with its own one-layer paged KV cache."""

    packed_modules = LlamaForCausalLM.packed_modules
    # Exports by the speculators library name the layer as a one-layer model's.
    checkpoint_renames = {"layers.0": "midlayer"}

    def __init__(
        self, config: Eagle3Config, max_positions: int, own_embedding: bool = False
    ) -> None:
        super().__init__()
        self.eagle = config
        self.config = config.model  # what the loader and KV sizing read
        cfg = config.model
        rotary_emb = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions)
        self.fc = Linear(3 * config.target_hidden_size, cfg.hidden_size)
        self.midlayer = Eagle3DecoderLayer(config, rotary_emb)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = LMHead(cfg.hidden_size, config.draft_vocab_size)
        self.d2t = nn.Parameter(
            torch.zeros(config.draft_vocab_size, dtype=torch.long), requires_grad=False
        )
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size) if own_embedding else None

    # `d2t` is the head's own parameter: the loader asks its owner to load it.
    def load_shard(self, param: Tensor, tensor: Tensor, shard: str | None, name: str) -> None:
        _copy_checked(param, tensor, name)

    def skip_checkpoint_tensor(self, name: str) -> bool:
        return name == "t2d"  # the mask form of d2t: not needed to map drafts

    @property
    def feature_size(self) -> int:
        """Width of the target features the head reads per token: three hidden states."""
        return 3 * self.eagle.target_hidden_size

    def fuse(self, features: Tensor) -> Tensor:
        """The target's aux hidden states [T, 3 Ht] -> the head's hidden input [T, H]."""
        return self.fc(features)

    def forward(
        self,
        embeds: Tensor,
        positions: Tensor,
        hidden: Tensor,
        kv_caches: list[Tensor],
        meta: AttentionMetadata,
    ) -> Tensor:
        """embeds [T, H] of the tokens after each position, hidden [T, H] (fused target
        features, or the previous step's output) -> the output before the norm [T, H]."""
        out, residual = self.midlayer(positions, embeds, hidden, kv_caches[0], meta)
        return out + residual

    def compute_logits(self, out: Tensor, target_lm_head=None) -> Tensor:
        """out [S, H] -> logits over the target's vocabulary [S, V]: the draft vocabulary's
        scores at their target ids, -inf elsewhere (a draft never proposes those)."""
        draft = self.lm_head.logits(self.norm(out))  # [S, draft_vocab]
        full = draft.new_full((draft.shape[0], self.config.vocab_size), float("-inf"))
        ids = torch.arange(self.eagle.draft_vocab_size, device=draft.device) + self.d2t
        full[:, ids] = draft
        return full

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        attn = self.midlayer.self_attn
        return (2, num_blocks, block_size, attn.num_kv_heads, attn.head_dim)


def load_eagle3_head(
    directory: str | Path,
    target: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int,
):
    """The head in `directory`, in the target's dtype, its rotary table covering
    max_positions (the published head's config says 2048; it drafts at the target's
    positions). Returns a LoadedModel whose config is the head's one-layer ModelConfig."""
    from safetensors import safe_open

    from compile_engine.models.loader import (
        LoadedModel,
        ModelSource,
        _iter_safetensors,
        _safetensors_files,
        load_weights,
        materialize,
    )

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{directory} has no config.json: not an EAGLE-3 head directory")
    config = read_eagle3_config(directory, target)
    files = _safetensors_files(directory)
    names: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    own_embedding = "embed_tokens.weight" in names
    positions = max(max_positions, config.model.max_position_embeddings)
    with torch.device("meta"):
        head = Eagle3Head(config, positions, own_embedding)
    head = head.to(dtype=dtype).eval().requires_grad_(False)
    materialize(head, device)
    load_weights(head, _iter_safetensors(files))
    return LoadedModel(head, config.model, None, ModelSource(directory, "hf"), dtype)
