"""Tiny random HF models of every supported architecture, saved with save_pretrained.

The HF model object is the oracle; the directory is what our loader reads.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

_COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    eos_token_id=2,
    bos_token_id=1,
    # Larger than HF's 0.02 so attention is far from uniform and a wrong scale, mask or
    # rotary shows up well above the tolerance.
    initializer_range=0.15,
)

# name -> (config class, model class, config overrides)
TINY_ARCHS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-mha-tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        # Four layers: the CPU decode graph calls the three between attentions as one subgraph.
        {"num_key_value_heads": 4, "tie_word_embeddings": True, "num_hidden_layers": 4},
    ),
    "llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "attention_bias": True,
        },
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24}),
}


def make_tiny_model(name: str, directory: Path, seed: int = 0):
    """Write a tiny random `name` model to `directory`; return the HF model (float32, eval)."""
    config_cls, model_cls, overrides = TINY_ARCHS[name]
    config = getattr(transformers, config_cls)(**{**_COMMON, **overrides})
    config.architectures = [model_cls]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so a loader that drops one
    # cannot pass.
    with torch.no_grad():
        for name_, param in model.named_parameters():
            if name_.endswith("norm.weight") or name_.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory)
    return model
