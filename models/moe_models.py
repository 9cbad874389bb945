"""Sparse-MoE decoders on the Llama skeleton: Mixtral, Qwen2-MoE, Qwen3-MoE.

The decoder is Llama's (models/llama.py): pre-norm, fused QKV, rotary, paged attention,
optional q/k norm (Qwen3). Only the MLP of the sparse layers changes, to a SparseMoE
(models/moe.py): router -> top-K experts -> weighted sum, plus Qwen2-MoE's gated shared expert.
Layers are built as Llama's and the sparse ones get their MLP swapped, on the meta device, so
nothing dense is ever allocated for them.

Checkpoint names. save_pretrained of transformers 5.17 writes the classic per-expert names
(`block_sparse_moe.experts.<e>.w1.weight` for Mixtral, `mlp.experts.<e>.gate_proj.weight` for
Qwen); in memory (and with save_original_format=False) transformers 5 holds them stacked as
`mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I], and calls Mixtral's
block `mlp`. Our parameters follow the in-memory layout (`mlp.experts.w13`, `mlp.experts.w2`);
`stacked_modules` and `checkpoint_renames` map both checkpoint layouts onto them.
"""

from __future__ import annotations

from compile_engine.models.config import config_from_hf
from compile_engine.models.errors import UnsupportedModelError
from compile_engine.models.llama import LlamaForCausalLM
from compile_engine.models.moe import MoEConfig, SparseMoE, sparse_layer_indices

# transformers 5's stacked expert tensors -> ours (the same layout, other names).
_STACKED_RENAMES = {"experts.gate_up_proj": "experts.w13", "experts.down_proj": "experts.w2"}


class _SparseMoEForCausalLM(LlamaForCausalLM):
    """Llama with a SparseMoE as the MLP of `config.sparse_layers`."""

    stacked_modules: dict[str, tuple[str, ...]] = {}
    checkpoint_renames: dict[str, str] = _STACKED_RENAMES

    def __init__(self, config: MoEConfig, max_positions: int | None = None) -> None:
        super().__init__(config, max_positions)
        for index in config.sparse_layers:
            self.model.layers[index].mlp = SparseMoE(config, shards=self.stacked_modules)


class MixtralForCausalLM(_SparseMoEForCausalLM):
    stacked_modules = {"w13": ("w1", "w3"), "w2": ("w2",)}
    checkpoint_renames = {"block_sparse_moe": "mlp", **_STACKED_RENAMES}

    @classmethod
    def config_from_hf(cls, hf) -> MoEConfig:
        if getattr(hf, "sliding_window", None) is not None:
            raise UnsupportedModelError(
                "Mixtral with a sliding_window is not supported; set it to null in config.json "
                "(exact only while sequences stay shorter than the window)"
            )
        return config_from_hf(
            hf,
            MoEConfig,
            num_experts=hf.num_local_experts,
            num_experts_per_tok=hf.num_experts_per_tok,
            moe_intermediate_size=hf.intermediate_size,
            sparse_layers=tuple(range(hf.num_hidden_layers)),
            norm_topk_prob=True,  # Mixtral always renormalises its top-K softmax
        )


def _qwen_moe_values(hf) -> dict:
    if getattr(hf, "use_sliding_window", False):
        raise UnsupportedModelError(
            f"{hf.architectures[0]} with use_sliding_window=true is not supported; set it to false"
        )
    return dict(
        num_experts=hf.num_experts,
        num_experts_per_tok=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size,
        sparse_layers=sparse_layer_indices(
            hf.num_hidden_layers,
            getattr(hf, "decoder_sparse_step", 1),
            tuple(getattr(hf, "mlp_only_layers", None) or ()),
        ),
        norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)),
        sliding_window=None,
    )


class Qwen2MoeForCausalLM(_SparseMoEForCausalLM):
    stacked_modules = {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}

    @classmethod
    def config_from_hf(cls, hf) -> MoEConfig:
        # Qwen2 puts biases on q/k/v only (qkv_bias in the config), never on o_proj.
        return config_from_hf(
            hf,
            MoEConfig,
            qkv_bias=bool(getattr(hf, "qkv_bias", True)),
            o_bias=False,
            shared_expert_intermediate_size=hf.shared_expert_intermediate_size,
            shared_expert_gate=True,
            **_qwen_moe_values(hf),
        )


class Qwen3MoeForCausalLM(_SparseMoEForCausalLM):
    stacked_modules = {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}

    @classmethod
    def config_from_hf(cls, hf) -> MoEConfig:
        bias = bool(getattr(hf, "attention_bias", False))
        return config_from_hf(
            hf, MoEConfig, qkv_bias=bias, o_bias=bias, qk_norm=True, **_qwen_moe_values(hf)
        )
