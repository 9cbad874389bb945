"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (MLA) and DeepSeekMoE.

A pre-norm decoder over a packed batch of T tokens, like models/llama.py, with two blocks of
its own:

    MLA (per layer; R = kv_lora_rank, P = qk_rope_head_dim, N = qk_nope_head_dim, V = v_head_dim)
        q            = q_proj(x)  or  q_b_proj(q_a_layernorm(q_a_proj(x)))   # [T, H, N + P]
        c_kv, k_pe   = kv_a_proj_with_mqa(x)                                  # [T, R], [T, P]
        latent       = [kv_a_layernorm(c_kv) | rotary(k_pe)]                  # [T, R + P]
        out          = mla_attention(q with rotary(q_pe), latent, latent cache, kv_b_proj)
        attn_out     = o_proj(out)                                            # [T, H V] -> [T, D]
    MLP: the first `first_k_dense_replace` layers are dense gated MLPs, the rest DeepSeekMoE
        (routed experts + shared experts; V2 softmax scores, V3 sigmoid scores with a
        correction bias, both with group-limited top-k and a routed scaling factor).

The cache holds one latent row per token and layer (`kv_cache_shape`), not K and V:
models/mla.py explains the ops, passes/mla_absorb.py rewrites attention into the absorbed
form that reads that row in place, docs/mla.md has the byte counts.

Rotary: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... (V2 always, V3 when
`rope_interleave`). We de-interleave q_pe and k_pe (evens then odds) and apply the neox
rotation of the `rotary` op; that is V3's `apply_rotary_pos_emb_interleave` exactly, and a
permutation of V2's complex-number rotation applied to both q and k, which leaves every score
unchanged. q_a_layernorm and kv_a_layernorm use HF's default eps 1e-6, not rms_norm_eps.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from compile_engine.models import mla
from compile_engine.models.config import config_from_hf
from compile_engine.models.layers import (
    AttentionMetadata,
    Embedding,
    FusedLinear,
    GatedMLP,
    Linear,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
)
from compile_engine.models.llama import DecoderLayer, LlamaForCausalLM, LlamaModel
from compile_engine.models.moe import MoEConfig, SparseMoE

# Per-expert checkpoint projections stacked into SparseMoE's w13 [E, 2I, H] and w2 [E, H, I].
EXPERT_SHARDS = {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}

# HF builds q_a_layernorm and kv_a_layernorm as DeepseekV2RMSNorm(rank): eps left at 1e-6.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class DeepseekConfig(MoEConfig):
    """MoEConfig (routing, experts, `sparse_layers`) plus the numbers of MLA."""

    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    attention_bias: bool = False
    attn_scale: float = 0.0  # softmax scale: qk_head_dim^-0.5, times yarn's mscale^2

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def kv_bytes_per_token(self, element_size: int) -> dict[str, int]:
        return mla.kv_bytes_per_token(
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            element_size=element_size,
        )


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(qk_head_dim: int, rope: dict) -> float:
    """HF's `yarn_apply_mscale`: with a scaled rope and mscale_all_dim, the attention logits
    are sharpened by mscale(factor, mscale_all_dim)^2 on top of 1/sqrt(qk_head_dim)."""
    scale = qk_head_dim**-0.5
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        mscale = _yarn_mscale(rope["factor"], rope["mscale_all_dim"])
        scale *= mscale * mscale
    return scale


def deepseek_config_from_hf(hf, *, version: int) -> DeepseekConfig:
    qk_head_dim = hf.qk_nope_head_dim + hf.qk_rope_head_dim
    if version == 2:
        # HF's V2 router: softmax, greedy or group-limited top-k, never renormalised (it
        # ignores norm_topk_prob), scaled by routed_scaling_factor.
        routing = dict(
            scoring_func="softmax",
            topk_method=hf.topk_method or "greedy",
            norm_topk_prob=False,
            e_score_correction_bias=False,
        )
        interleave = True
    else:
        # HF's V3 router: sigmoid scores plus e_score_correction_bias choose the experts
        # (groups scored by their two best, topk_group of n_group kept), the unbiased sigmoid
        # scores weight them.
        routing = dict(
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            norm_topk_prob=bool(hf.norm_topk_prob),
            e_score_correction_bias=True,
        )
        interleave = bool(getattr(hf, "rope_interleave", True))
    num_experts = int(getattr(hf, "n_routed_experts", None) or 0)
    first_dense = int(getattr(hf, "first_k_dense_replace", None) or 0)
    moe_inter = int(getattr(hf, "moe_intermediate_size", None) or 0)
    cfg = config_from_hf(
        hf,
        DeepseekConfig,
        head_dim=qk_head_dim,
        num_kv_heads=hf.num_attention_heads,
        o_bias=bool(hf.attention_bias),
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        sliding_window=None,
        q_lora_rank=hf.q_lora_rank,
        kv_lora_rank=hf.kv_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim,
        qk_rope_head_dim=hf.qk_rope_head_dim,
        v_head_dim=hf.v_head_dim,
        rope_interleave=interleave,
        attention_bias=bool(hf.attention_bias),
        num_experts=num_experts,
        num_experts_per_tok=int(getattr(hf, "num_experts_per_tok", None) or 0),
        moe_intermediate_size=moe_inter,
        # first_k_dense_replace dense layers, then MoE (none without routed experts).
        sparse_layers=tuple(range(first_dense, hf.num_hidden_layers)) if num_experts else (),
        shared_expert_intermediate_size=int(getattr(hf, "n_shared_experts", None) or 0) * moe_inter,
        n_group=int(getattr(hf, "n_group", None) or 1),
        topk_group=int(getattr(hf, "topk_group", None) or 1),
        routed_scaling_factor=float(getattr(hf, "routed_scaling_factor", None) or 1.0),
        router_fp32=True,  # HF computes DeepSeek's router logits in float32
        **routing,
    )
    return dataclasses.replace(cfg, attn_scale=softmax_scale(qk_head_dim, cfg.rope))


def _deinterleave(x: Tensor) -> Tensor:
    """[..., P] pairs (x0, x1), (x2, x3), ... -> [x0, x2, ..., x1, x3, ...] (neox halves)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class MLAttention(nn.Module):
    """Multi-head latent attention over the packed batch and a paged latent cache."""

    def __init__(self, config: DeepseekConfig, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.kv_lora_rank, self.q_lora_rank = config.kv_lora_rank, config.q_lora_rank
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.interleaved = config.rope_interleave
        self.scale = config.attn_scale
        q_out = self.num_heads * config.qk_head_dim
        latent = self.kv_lora_rank + self.rope
        # Both down-projections read the layer input: one GEMM (q_a_proj only with q_lora).
        shards = {"kv_a_proj_with_mqa": latent}
        if self.q_lora_rank is not None:
            shards = {"q_a_proj": self.q_lora_rank, **shards}
        self.qkv_a_proj = FusedLinear(config.hidden_size, shards, bias=config.attention_bias)
        if self.q_lora_rank is None:
            self.q_proj = Linear(config.hidden_size, q_out)
        else:
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(self.q_lora_rank, q_out)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_head_dim))
        self.o_proj = Linear(
            self.num_heads * self.v_head_dim, config.hidden_size, bias=config.attention_bias
        )
        self.rotary_emb = rotary_emb

    def forward(
        self, positions: Tensor, hidden: Tensor, latent_cache: Tensor, meta: AttentionMetadata
    ) -> Tensor:
        num_tokens = hidden.shape[0]
        down = self.qkv_a_proj(hidden)  # [T, (q_lora) + R + P]
        if self.q_lora_rank is None:
            latent = down  # [T, R + P]
            q = self.q_proj(hidden)  # [T, H (N + P)]
        else:
            q_a, latent = down.split([self.q_lora_rank, self.kv_lora_rank + self.rope], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_a))  # [T, H (N + P)]
        q = q.view(num_tokens, self.num_heads, self.nope + self.rope)  # [T, H, N + P]
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.rope], dim=-1)  # [T, R], [T, P]
        k_pe = k_pe.unsqueeze(1)  # [T, 1, P]: one rotated key part shared by every head
        if self.interleaved:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)
        q = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, N + P]
        kv_latent = torch.cat([self.kv_a_layernorm(c_kv), k_pe.squeeze(1)], dim=-1)  # [T, R + P]
        out = mla.mla_attention(
            q,
            kv_latent,
            latent_cache,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.kv_b_proj.weight,
            self.scale,
        )  # [T, H, V]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_head_dim))


class DeepseekDecoderLayer(DecoderLayer):
    """The Llama pre-norm layer (its forward) with MLA attention and, past
    first_k_dense_replace, a sparse MoE."""

    def __init__(self, config: DeepseekConfig, index: int, rotary_emb: RotaryEmbedding) -> None:
        nn.Module.__init__(self)  # not DecoderLayer.__init__: different modules
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config, rotary_emb)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if index in config.sparse_layers:
            self.mlp = SparseMoE(config, shards=EXPERT_SHARDS, shared_expert_name="shared_experts")
        else:
            self.mlp = GatedMLP(config)


class DeepseekModel(LlamaModel):
    """LlamaModel's forward over DeepSeek layers; each layer's cache is its latent cache."""

    def __init__(self, config: DeepseekConfig, max_positions: int) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        rotary_emb = RotaryEmbedding(config.rope, config.qk_rope_head_dim, max_positions)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, i, rotary_emb) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.aux_hidden_layers: tuple[int, ...] = ()  # LlamaModel's: none by default


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    # Checkpoint projections that land in one fused parameter: checked by the loader.
    packed_modules = {
        "qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }
    # Routed experts: per-expert tensors stack into w13/w2; transformers 5 may save them
    # stacked already, under other names.
    stacked_modules = EXPERT_SHARDS
    checkpoint_renames = {"experts.gate_up_proj": "experts.w13", "experts.down_proj": "experts.w2"}
    version = 2

    @classmethod
    def config_from_hf(cls, hf) -> DeepseekConfig:
        return deepseek_config_from_hf(hf, version=cls.version)

    def __init__(self, config: DeepseekConfig, max_positions: int | None = None) -> None:
        nn.Module.__init__(self)  # LlamaForCausalLM.__init__ would build a LlamaModel
        self.config = config
        self.model = DeepseekModel(config, max_positions or config.max_position_embeddings)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = LMHead(config.hidden_size, config.vocab_size)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """One layer's paged latent cache: [kv_a_layernorm(c_kv) | rotated k_pe] per token
        slot, R + P numbers (576 for DeepSeek-V2/V3) instead of K and V of every head."""
        cfg = self.config
        return (num_blocks, block_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    version = 3

    def skip_checkpoint_tensor(self, name: str) -> bool:
        """DeepSeek-V3 checkpoints carry the multi-token-prediction module as extra decoder
        layers (model.layers.61.* after 61 layers); like transformers, we do not run it."""
        parts = name.split(".")
        return (
            len(parts) > 2
            and parts[:2] == ["model", "layers"]
            and parts[2].isdigit()
            and int(parts[2]) >= self.config.num_layers
        )
