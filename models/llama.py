"""The Llama family: Llama 2/3/3.1, Mistral, SmolLM2; Qwen2 and Qwen3 differ only in biases
and q/k norm, declared by their config hooks below.

A pre-norm decoder over a packed batch of T tokens from many sequences:

    h = embed(input_ids)                                  # [T, H]
    for each layer:
        x, h = add_rms_norm(attn_out, h)                  # residual stream kept in h
        attn_out = o_proj(paged_attention(rotary(qkv_proj(x))))
        x, h = add_rms_norm(attn_out, h)
        mlp_out = down_proj(silu_and_mul(gate_up_proj(x)))
    hidden = rms_norm(mlp_out + h)                        # [T, H]
    logits = hidden[sampled rows] @ lm_head^T             # [S, V], computed by compute_logits
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from compile_engine.models.config import ModelConfig, config_from_hf
from compile_engine.models.errors import UnsupportedModelError
from compile_engine.models.layers import (
    Attention,
    AttentionMetadata,
    Embedding,
    GatedMLP,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, rotary_emb)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config)

    def forward(
        self,
        positions: Tensor,
        hidden: Tensor,
        residual: Tensor | None,
        kv_cache: Tensor,
        meta: AttentionMetadata,
    ) -> tuple[Tensor, Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        rotary_emb = RotaryEmbedding(config.rope, config.head_dim, max_positions)
        self.layers = nn.ModuleList(
            DecoderLayer(config, rotary_emb) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # EAGLE-3 heads read the residual stream entering these layers (`expose_aux_hidden_
        # states`); none by default.
        self.aux_hidden_layers: tuple[int, ...] = ()

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[Tensor],
        meta: AttentionMetadata,
    ) -> Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, H]
        residual = None
        aux: dict[int, Tensor] = {}  # layer id -> the residual stream entering it
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if i in self.aux_hidden_layers:
                aux[i] = hidden if residual is None else hidden + residual
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        if len(self.layers) in self.aux_hidden_layers:
            aux[len(self.layers)] = hidden + residual
        hidden, _ = self.norm(hidden, residual)
        if aux:
            # In the order asked (a head's fc reads them so), one tensor out, so that compiled
            # pieces and CUDA graphs keep one output buffer.
            states = [aux[i] for i in self.aux_hidden_layers]
            return torch.cat([hidden, *states], dim=-1)  # [T, H + A H]
        return hidden  # [T, H]


class LlamaForCausalLM(nn.Module):
    # Checkpoint projections that land in one fused parameter: checked by the loader.
    packed_modules = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    @classmethod
    def config_from_hf(cls, hf) -> ModelConfig:
        bias = bool(getattr(hf, "attention_bias", False))
        return config_from_hf(
            hf, qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(hf, "mlp_bias", False))
        )

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        # Parameter names mirror the HF checkpoint (model.layers.N..., lm_head) so that loading
        # is a lookup plus the packed_modules table.
        self.model = LlamaModel(config, max_positions or config.max_position_embeddings)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = LMHead(config.hidden_size, config.vocab_size)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[Tensor],
        meta: AttentionMetadata,
    ) -> Tensor:
        """input_ids, positions [T] -> final hidden states [T, H]."""
        return self.model(input_ids, positions, kv_caches, meta)

    def expose_aux_hidden_states(self, layers: tuple[int, ...]) -> None:
        """Make forward return [T, H + len(layers) H]: the final hidden states, then the
        residual stream entering each of `layers` (id num_layers: the last layer's output
        before the norm), which an EAGLE-3 head reads (runtime/speculative_heads.py). Set
        before the forward is compiled: the graph captures the wider output."""
        self.model.aux_hidden_layers = tuple(layers)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """One layer's paged KV cache: K and V per token slot; block 0 is the runtime's
        scratch (padding tokens write there). MLA models cache a latent instead."""
        # The heads of the attention modules, not the config's: a tensor-parallel rank holds
        # only its own KV heads (models/parallel.py), and so does its cache.
        attn = self.model.layers[0].self_attn
        return (2, num_blocks, block_size, attn.num_kv_heads, attn.head_dim)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [S, H] of the rows that sample -> logits [S, V]."""
        lm_head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return lm_head.logits(hidden)


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def config_from_hf(cls, hf) -> ModelConfig:
        if getattr(hf, "use_sliding_window", False):
            raise UnsupportedModelError(
                "Qwen2 with use_sliding_window=true is not supported; set it to false"
            )
        # Qwen2 puts biases on q/k/v only, never on o_proj.
        return config_from_hf(hf, qkv_bias=True, o_bias=False, sliding_window=None)


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def config_from_hf(cls, hf) -> ModelConfig:
        if getattr(hf, "use_sliding_window", False):
            raise UnsupportedModelError(
                "Qwen3 with use_sliding_window=true is not supported; set it to false"
            )
        bias = bool(getattr(hf, "attention_bias", False))
        return config_from_hf(hf, qkv_bias=bias, o_bias=bias, qk_norm=True, sliding_window=None)
