"""compile-engine: an LLM inference and serving engine whose speed comes from a compiler.

The distribution's root package. Its subpackages are the card's layer folders at the top of
the repository (models, kernels_generated, passes, compiler, runtime, benchmarks), mapped here
by `package-dir` in pyproject.toml (docs/architecture.md, "Layout"); this package adds the public
API and the `compile-engine` command line (cli.py), the one place above every layer.

    from compile_engine import LLM, SamplingParams

Imports are lazy: `compile-engine --help` and the torch-free runtime pieces (scheduler, KV
cache manager) must not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from compile_engine.runtime.async_engine import AsyncLLM
    from compile_engine.runtime.engine import EngineConfig, LLMEngine, RequestOutput
    from compile_engine.runtime.llm import LLM
    from compile_engine.runtime.sampling_params import SamplingParams

# Public name -> the module that defines it.
_EXPORTS = {
    "LLM": "compile_engine.runtime.llm",
    "SamplingParams": "compile_engine.runtime.sampling_params",
    "AsyncLLM": "compile_engine.runtime.async_engine",
    "EngineConfig": "compile_engine.runtime.engine",
    "LLMEngine": "compile_engine.runtime.engine",
    "RequestOutput": "compile_engine.runtime.engine",
}

__all__ = ["LLM", "SamplingParams", "AsyncLLM", "EngineConfig", "LLMEngine", "RequestOutput"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'compile_engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
