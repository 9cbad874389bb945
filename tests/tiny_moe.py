"""Tiny random MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE) saved with save_pretrained.

Kept apart from tests/tiny_models.TINY_ARCHS, whose every entry runs the whole engine and
compiler suites: the MoE models are checked against HF in tests/models/test_moe_models.py and
compiled in tests/passes/test_moe_pass.py.
"""

from __future__ import annotations

import torch
import transformers

_COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    eos_token_id=2,
    bos_token_id=1,
    initializer_range=0.15,
)

# name -> (config class, model class, overrides). Expert counts and top-k differ per model so
# that a mix-up of E, K or the expert width cannot pass.
MOE_ARCHS: dict[str, tuple[str, str, dict]] = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_hidden_layers=2, intermediate_size=48, num_local_experts=6, num_experts_per_tok=2),
    ),
    # Layer 1 dense (mlp_only_layers): a sparse, a dense and a sparse MLP; the shared expert
    # with its sigmoid gate; top-k weights not renormalised (Qwen2-MoE's default).
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_hidden_layers=3,
            intermediate_size=80,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=40,
            num_experts=8,
            num_experts_per_tok=3,
            mlp_only_layers=[1],
            tie_word_embeddings=True,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_hidden_layers=2,
            intermediate_size=80,
            moe_intermediate_size=32,
            num_experts=10,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            head_dim=24,
        ),
    ),
}


def make_tiny_moe(name: str, directory, *, stacked: bool = False, seed: int = 0):
    """Write a tiny random `name` model; return the HF model (float32, eval)."""
    config_cls, model_cls, overrides = MOE_ARCHS[name]
    config = getattr(transformers, config_cls)(**{**_COMMON, **overrides})
    config.architectures = [model_cls]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # norms at 1 and biases at 0 would hide a loader that drops them
        for pname, param in model.named_parameters():
            if pname.endswith("norm.weight") or pname.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory, save_original_format=not stacked)
    return model
