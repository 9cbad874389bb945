"""The serving runtime: scheduler, KV cache manager, model runner, sampler, engine, server.

`from runtime import LLM, SamplingParams` is the public offline API. Imports are lazy so that
the torch-free pieces (scheduler, KV cache manager) stay importable without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from runtime.llm import LLM

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from runtime.llm import LLM

        return LLM
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
