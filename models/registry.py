"""config.json `architectures` -> model class. Anything else is a clear error."""

from __future__ import annotations

from torch import nn

from compile_engine.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from compile_engine.models.errors import UnsupportedModelError
from compile_engine.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from compile_engine.models.moe_models import (
    MixtralForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}


def model_class(architectures: list[str] | None) -> type[nn.Module]:
    for arch in architectures or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise UnsupportedModelError(
        f"architecture {architectures or 'missing'} is not supported; "
        f"supported: {', '.join(sorted(ARCHITECTURES))}"
    )
