"""The engine's settings, one validated dataclass (vLLM's names), set from `LLM(...)` or the
command line (runtime/engine_args.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from compile_engine.compiler.artifact import Manifest, is_artifact
from compile_engine.kernels_generated.tuning import KernelConfig, KernelConfigError
from compile_engine.runtime.speculative_config import SpeculativeConfig, SpeculativeConfigError

TARGETS = {"cpu": "cpu", "h100": "cuda"}
# What --dtype takes (vLLM's names): "auto" keeps the checkpoint's.
DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")


class EngineConfigError(ValueError):
    """An engine setting is invalid; the message names it and what is allowed."""


@dataclass(slots=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    target: str | None = None  # cpu | h100; None picks h100 when CUDA is present
    block_size: int = 16
    num_kv_blocks: int | None = None
    # How many max_model_len sequences the default KV pool is sized for (num_kv_blocks unset);
    # None: max_num_seqs. One-shot uses that know their requests (`compile-engine generate`)
    # pass fewer: on CPU the default pool is 4 GiB, zero-filled at start.
    kv_pool_sequences: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # The largest step (in tokens) that replays a CUDA graph; None: the artifact's build
    # setting, else MAX_GRAPH_TOKENS (2,048). Larger steps run the compiled pieces one by one
    # (compiler/cuda_graphs.py).
    max_cuda_graph_tokens: int | None = None
    # The share of the GPU's memory the engine may use (vLLM's): weights, activations and the
    # KV pool, which gets what is left when num_kv_blocks is unset.
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    seed: int = 0
    max_waiting: int | None = None
    passes: str | None = None  # see passes/registry.py: "+name,-name" or "a,b"
    # Our kernels' launch choices (kernels_generated/tuning.py): a KernelConfig, its dict or
    # JSON form (`--kernel-config`), None for the defaults; an artifact's own when loading one.
    kernel_config: KernelConfig | dict | str | None = None
    cuda_graphs: bool = True  # off: compiled pieces run without graphs (for measurements)
    # Schedule and prepare step N+1 while step N runs on the device. Off, or while any live
    # request uses a penalty (which needs every previous token on the host), steps run one at
    # a time.
    async_scheduling: bool = True
    # vLLM's --reasoning-parser (runtime/reasoning_parsers.py): the output's thinking part is
    # split off by the server, and a structured-output grammar applies after it.
    reasoning_parser: str | None = None
    # A structured-output grammar that takes longer to compile is refused (a 400).
    grammar_compile_timeout_s: float = 5.0
    # None, or "fp8": vLLM's online FP8 of a model-dtype checkpoint (per-channel weights,
    # dynamic per-token activations); an FP8 checkpoint runs as saved either way
    # (models/quant.py). An artifact's own when loading one.
    quantization: str | None = None
    # The paged KV cache's element type (vLLM's kv_cache_dtype): "auto" the model dtype (an
    # artifact's own when loading one), "fp8" / "fp8_e4m3" float8 e4m3 scaled per tensor by each
    # attention layer's checkpoint k_scale / v_scale (1.0 without): twice the blocks in the
    # same memory, attention reading half the bytes (models/ops.py).
    kv_cache_dtype: str = "auto"
    # Ranks the model is sharded over (vLLM's name): one process each, this one rank 0
    # (runtime/parallel.py); the group size must divide the heads and MLP widths it splits.
    tensor_parallel_size: int = 1
    # MoE experts distributed whole over the ranks instead of each sliced (vLLM's name).
    enable_expert_parallel: bool = False
    # A rank that has not finished a step this long after it was sent is declared hung, and
    # the engine ends with an error naming it (a rank that exits is named at once).
    distributed_timeout_s: float = 20.0
    # Speculative decoding (runtime/speculative_config.py, vLLM's speculative_config): a
    # SpeculativeConfig, its dict or JSON form; None: off.
    speculative_config: SpeculativeConfig | dict | str | None = None

    def __post_init__(self) -> None:
        if self.target is None:
            if is_artifact(self.model):
                self.target = Manifest.read(Path(self.model)).target
            else:
                self.target = "h100" if torch.cuda.is_available() else "cpu"
        if self.target not in TARGETS:
            raise EngineConfigError(
                f"target {self.target!r} is not supported; use one of {', '.join(TARGETS)}"
            )
        if TARGETS[self.target] == "cuda" and not torch.cuda.is_available():
            raise EngineConfigError(f"target {self.target} needs a CUDA device; use --target cpu")
        if self.dtype not in DTYPES:
            raise EngineConfigError(
                f"dtype={self.dtype!r} is not supported; use one of {', '.join(DTYPES)}"
            )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise EngineConfigError(f"{name}={value!r} is invalid: must be an integer >= 1")
        for name, least in (("num_kv_blocks", 2), ("max_model_len", 1), ("max_waiting", 1)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < least):
                why = " (block 0 is the scratch block padding writes into)" if least == 2 else ""
                raise EngineConfigError(
                    f"{name}={value!r} is invalid: must be an integer >= {least}{why}"
                )
        utilization = self.gpu_memory_utilization
        if not isinstance(utilization, int | float) or not 0 < utilization <= 1:
            raise EngineConfigError(
                f"gpu_memory_utilization={utilization!r} is invalid: must be in (0, 1]"
            )
        graph_tokens = self.max_cuda_graph_tokens
        if graph_tokens is not None and (not isinstance(graph_tokens, int) or graph_tokens < 1):
            raise EngineConfigError(
                f"max_cuda_graph_tokens={graph_tokens!r} is invalid: must be an integer >= 1"
            )
        pool = self.kv_pool_sequences
        if pool is not None and (not isinstance(pool, int) or pool < 1):
            raise EngineConfigError(
                f"kv_pool_sequences={pool!r} is invalid: must be an integer >= 1"
            )
        self._check_parallel()
        if self.passes is not None:
            from compile_engine.passes.registry import UnknownPassError, select

            try:
                select(self.passes)
            except UnknownPassError as exc:
                raise EngineConfigError(f"passes={self.passes!r}: {exc}") from None
        if self.quantization is not None:
            from compile_engine.models.quant import QUANTIZATIONS

            if self.quantization not in QUANTIZATIONS:
                raise EngineConfigError(
                    f"quantization={self.quantization!r} is not supported; use one of "
                    f"{', '.join(QUANTIZATIONS)} (or none)"
                )
        from compile_engine.models.ops import KV_CACHE_DTYPES

        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise EngineConfigError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; use one of "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )
        if self.kv_cache_dtype != "auto" and self.tensor_parallel_size > 1:
            raise EngineConfigError(
                "kv_cache_dtype fp8 does not run tensor-parallel yet (the ranks allocate caches "
                "of the model dtype); use tensor_parallel_size 1, or kv_cache_dtype 'auto'"
            )
        if self.kernel_config is not None:
            try:
                self.kernel_config = KernelConfig.coerce(self.kernel_config)
            except KernelConfigError as exc:
                raise EngineConfigError(f"kernel_config: {exc}") from None

        if self.reasoning_parser is not None:
            from compile_engine.runtime.reasoning_parsers import reasoning_parser

            try:
                reasoning_parser(self.reasoning_parser)
            except ValueError as exc:
                raise EngineConfigError(f"reasoning_parser: {exc}") from None
        timeout = self.grammar_compile_timeout_s
        if not isinstance(timeout, int | float) or not 0 < timeout <= 600:
            raise EngineConfigError(
                f"grammar_compile_timeout_s={timeout!r} is invalid: must be in (0, 600] seconds"
            )
        try:
            self.speculative_config = SpeculativeConfig.coerce(self.speculative_config)
        except (SpeculativeConfigError, TypeError) as exc:
            raise EngineConfigError(f"speculative_config: {exc}") from None
        if self.speculative_config is not None and self.tensor_parallel_size > 1:
            raise EngineConfigError(
                "speculative_config does not run tensor-parallel yet (the draft model and the "
                "verification are untested across ranks); use tensor_parallel_size 1"
            )

    def _check_parallel(self) -> None:
        size = self.tensor_parallel_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise EngineConfigError(
                f"tensor_parallel_size={size!r} is invalid: must be an integer >= 1"
            )
        if self.enable_expert_parallel and size < 2:
            raise EngineConfigError(
                "enable_expert_parallel needs tensor_parallel_size >= 2: it spreads the experts "
                "over the tensor-parallel ranks"
            )
        timeout = self.distributed_timeout_s
        if not isinstance(timeout, int | float) or timeout <= 0:
            raise EngineConfigError(
                f"distributed_timeout_s={timeout!r} is invalid: must be a number of seconds > 0"
            )
        if size > 1 and self.quantization is not None:
            raise EngineConfigError(
                "quantization does not run tensor-parallel yet (its layers are not sharded); "
                "use tensor_parallel_size 1, or the checkpoint's bf16 weights"
            )
        if size > 1 and TARGETS[self.target] == "cuda":
            if size > torch.cuda.device_count():
                raise EngineConfigError(
                    f"tensor_parallel_size={size} needs {size} GPUs; this machine has "
                    f"{torch.cuda.device_count()}"
                )
            if self.num_kv_blocks is None:
                # Not done: sizing the pool from memory measures an eager forward on rank 0
                # alone, which the sharded model cannot run without its other ranks.
                raise EngineConfigError(
                    "tensor_parallel_size > 1 on a GPU needs num_kv_blocks set (sizing the KV "
                    "pool from memory is not done for tensor parallelism yet)"
                )

    @property
    def device(self) -> torch.device:
        return torch.device(TARGETS[self.target])
