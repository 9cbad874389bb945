"""Tiny random DeepSeek-V2/V3 models (MLA + DeepSeekMoE), saved with save_pretrained.

Kept apart from tests/tiny_models.TINY_ARCHS, whose every entry runs the whole engine
scenario matrix: the DeepSeek tests pick their own scenarios (tests/models/test_deepseek.py).
The HF model object is the oracle; the directory is what our loader reads.

Sizes are chosen so that a mix-up cannot cancel out: the value head (24) differs from the
nope head (16), the latent rank (32) from both, q_lora (48) from the hidden size (64); the
latent rank and rope dims are powers of two >= 16 as the Triton kernel's tl.dot wants (it
masks other sizes, which tests/kernels/test_mla_attention.py covers).
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

_COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=24,
    n_routed_experts=8,
    n_shared_experts=2,
    num_experts_per_tok=2,
    first_k_dense_replace=1,  # layer 0 dense, layers 1 and 2 MoE
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    eos_token_id=2,
    bos_token_id=1,
    # Larger than HF's 0.02 so attention is far from uniform and a wrong scale, mask or
    # rotary shows up well above the tolerance.
    initializer_range=0.15,
)

_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,  # the softmax scale gets mscale(4, 1)^2 on top of 1/sqrt(32)
    "beta_fast": 32,
    "beta_slow": 1,
}

# name -> (config class, model class, config overrides)
TINY_DEEPSEEK: dict[str, tuple[str, str, dict]] = {
    # No q_lora (DeepSeek-V2-Lite's layout), greedy softmax routing.
    "deepseek-v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {"q_lora_rank": None}),
    # q_lora, group-limited greedy routing, routed scaling.
    "deepseek-v2-qlora": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        {
            "q_lora_rank": 48,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 1.5,
        },
    ),
    # V3: q_lora, sigmoid scores with a correction bias, noaux_tc groups, normalised and
    # scaled weights, yarn rope with mscale in the softmax scale, interleaved rope.
    "deepseek-v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            "q_lora_rank": 48,
            "n_group": 2,
            "topk_group": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "rope_parameters": _YARN,
            "rope_interleave": True,
        },
    ),
}


def make_tiny_deepseek(name: str, directory: Path, seed: int = 0, mtp: bool = False):
    """Write a tiny random `name` model to `directory`; return the HF model (float32, eval).
    With `mtp`, the checkpoint also holds one multi-token-prediction layer at index
    num_hidden_layers, as DeepSeek-V3's does (`add_mtp_layer`)."""
    config_cls, model_cls, overrides = TINY_DEEPSEEK[name]
    config = getattr(transformers, config_cls)(**{**_COMMON, **overrides})
    config.architectures = [model_cls]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    # Random init leaves norms at 1, biases and V3's correction bias at 0; perturb them so a
    # loader that drops one cannot pass. The bias moves by about the spread of the sigmoid
    # scores, enough to change which experts some tokens pick.
    with torch.no_grad():
        for name_, param in model.named_parameters():
            if name_.endswith("norm.weight") or name_.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
        for name_, buffer in model.named_buffers():
            if name_.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    model.save_pretrained(directory)
    if mtp:
        add_mtp_layer(model, directory, seed=seed + 1)
    return model


def add_mtp_layer(model, directory: Path, seed: int = 1) -> None:
    """Append DeepSeek-V3's MTP layer to the saved `model` in `directory`: the decoder layer
    HF would build at index num_hidden_layers (MoE: past first_k_dense_replace), randomly
    initialised by HF, with enorm, hnorm, eh_proj, shared_head and the copies of the
    embedding and head V3's checkpoint carries; num_nextn_predict_layers 1 in config.json."""
    import copy
    import json

    from safetensors.torch import save_file

    config = model.config
    layers = config.num_hidden_layers
    longer = copy.deepcopy(config)
    longer.num_hidden_layers = layers + 1
    torch.manual_seed(seed)
    donor = type(model)(longer).eval()
    prefix = f"model.layers.{layers}."
    h = config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    tensors = {prefix + k: v.clone() for k, v in donor.model.layers[layers].state_dict().items()}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{prefix}{name}.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    tensors[prefix + "eh_proj.weight"] = 0.15 * torch.randn(h, 2 * h, generator=gen)
    tensors[prefix + "shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    tensors[prefix + "embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    with torch.no_grad():
        for key, value in tensors.items():
            if key.endswith("e_score_correction_bias"):
                value.copy_(torch.randn(value.shape, generator=gen) * 0.1)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(Path(directory) / "model-mtp.safetensors"),
        metadata={"format": "pt"},
    )
    raw = json.loads((Path(directory) / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (Path(directory) / "config.json").write_text(json.dumps(raw, indent=2))
