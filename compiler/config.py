"""Compile settings, and the one function that applies them to Inductor and Dynamo.

Nothing here runs at import: `apply_inductor_settings` is called by whoever compiles, at
build or load time (STYLE #12).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.tuning import KernelConfig

TARGETS = ("cpu", "h100")


class CompileConfigError(ValueError):
    """A compile setting is invalid; the message says what is allowed."""


@dataclass(slots=True)
class CompileConfig:
    target: str = "cpu"
    passes: str | None = None  # "+name,-name" relative to the defaults, or "a,b" exactly
    cache_dir: Path | None = None  # Inductor + Triton cache; an artifact ships its own
    kernel: KernelConfig = field(default_factory=tuning.default)  # our kernels' launch choices

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise CompileConfigError(
                f"target {self.target!r} is not supported; use one of {', '.join(TARGETS)}"
            )


def default_cache_dir() -> Path:
    """The persistent cache of in-process compiles (artifacts carry their own).
    COMPILE_ENGINE_CACHE_DIR overrides it, e.g. to share one cache across a CI run."""
    if override := os.environ.get("COMPILE_ENGINE_CACHE_DIR"):
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "compile-engine" / "inductor"


def pin_triton_toolchain() -> None:
    """Point Triton at the ptxas (and, as Inductor's settings say, libdevice) that Inductor
    compiles its own kernels with, before anything compiles.

    Inductor sets these paths in the process only when it compiles a kernel there, not when its
    compile workers do, and they enter every Triton kernel's cache key, ours included. A build
    compiles Inductor's kernels in workers; a load of an artifact whose Inductor kernels cannot
    be launched statically (TORCHINDUCTOR_ENABLE_PDL=1) compiles them in the process, so our
    kernels hashed differently there and all 21-23 compiled again at load (H200, 70ccb5a:
    identical Triton IR and metadata, new cache keys; ready in 35 s). Set first, build and
    load agree whichever way Inductor compiles."""
    from torch._inductor.runtime import compile_tasks

    compile_tasks._set_triton_ptxas_path()
    # Newer torch also swaps in CUDA's libdevice (when its eager-numerics settings ask); where
    # torch has no such step, Inductor does not take it either.
    set_libdevice = getattr(compile_tasks, "_set_triton_libdevice_path", None)
    if set_libdevice is not None:
        set_libdevice()


def apply_inductor_settings(config: CompileConfig) -> Path:
    """Point Inductor and Triton at the cache dir and set the options our artifacts rely on.
    Returns the cache dir in use."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    cache_dir = Path(config.cache_dir or default_cache_dir()).resolve()
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Read by Inductor at each use, so switching artifacts within one process works.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    os.environ["TRITON_CACHE_DIR"] = str(cache_dir / "triton")
    inductor_config.fx_graph_cache = True
    # A precompiled header lives in a fresh temp dir per process and its path enters the
    # C++ cache key: with it on, every load recompiles every kernel with g++ (measured).
    inductor_config.cpp_cache_precompile_headers = False
    # Skip the per-process C++ ISA probe builds (~10 g++ runs, seconds each on 2 cores): the
    # ISA still comes from the CPU's flags, and build and load must agree on this setting
    # because it enters Inductor's cache key.
    inductor_config.cpp.vec_isa_ok = True
    # No programmatic dependent launch for Inductor's own Triton kernels (ours have it, by the
    # kernel config): with ours on, 234.3 / 234.9 tok/s at batch 1 against 233.7 / 234.2 off,
    # batch 64 13,097 against 13,212 (465b34f, H200, one call), within the spread. Set here,
    # whatever TORCHINDUCTOR_ENABLE_PDL says: it enters Inductor's cache key, so build and load
    # must agree.
    inductor_config.triton.enable_pdl = False
    if config.target == "h100":
        pin_triton_toolchain()
    # On the CPU no `assert_size_stride` on each input of each compiled graph and subgraph:
    # the runner hands the graphs the shapes and strides they were traced with (Dynamo's guards
    # check them), and the checks were a tenth of SmolLM2's batch-1 step on the 2-core EPYC
    # (docs/compiler.md). CUDA keeps them: its decode steps replay graphs. A cache-key setting.
    inductor_config.size_asserts = config.target != "cpu"
    # Floats such as eps stay constants in the graph instead of becoming inputs.
    dynamo_config.specialize_float = True
    # One graph per model is captured once; later calls must never retrace it.
    dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 8)
    return cache_dir
