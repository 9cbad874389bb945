"""Start-up: everything an `LLMEngine` needs, built in order and handed over complete.

`build_engine(config)` resolves an artifact's settings, loads the model (its weights read on a
thread while the rest proceeds), the tokenizer, the compiled forward, sizes and allocates the
KV cache, captures the forward's graph and its CUDA graphs, and returns an `EngineParts`
holding a finished `Scheduler` and `ModelRunner`: nothing is set on them afterwards.

Start-up phases of this thread are timed disjointly, in order, summing to `ready_s`
(`bench startup` reports them); the weight read runs beside them (`weights_read_s`), and the
phases count only this thread's wait for it (`weights_wait_s`).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from compile_engine.compiler.artifact import Manifest, device_description, is_artifact
from compile_engine.compiler.compiled_model import CompiledForward
from compile_engine.compiler.config import CompileConfig
from compile_engine.compiler.cuda_graphs import CUDAGraphRunner, default_capture_sizes
from compile_engine.kernels_generated.tuning import KernelConfig
from compile_engine.models.config import ModelConfig, config_from_dict, config_to_dict
from compile_engine.models.loader import (
    LoadedModel,
    WeightRead,
    check_kv_cache_dtype,
    open_model,
    resolve_config,
)
from compile_engine.models.tokenizer import SAVED_DIR, load_tokenizer
from compile_engine.runtime.activation_profile import activation_bytes
from compile_engine.runtime.activation_profile import lookup as lookup_activation_bytes
from compile_engine.runtime.engine_config import EngineConfig, EngineConfigError
from compile_engine.runtime.model_runner import (
    GRAPH_HEAD_MAX_ROWS,
    ModelRunner,
    allocate_kv_caches,
    default_num_blocks,
    logits_and_argmax,
)
from compile_engine.runtime.parallel import (
    WorkerGroup,
    WorkerSpec,
    backend_for,
    init_groups,
    run_worker,
    torchrun_launch,
)
from compile_engine.runtime.reasoning_parsers import reasoning_parser
from compile_engine.runtime.scheduler import InvalidSchedulerConfig, Scheduler, SchedulerConfig
from compile_engine.runtime.speculative import build_speculator, load_draft, share_kv_pool
from compile_engine.runtime.speculative_heads import load_head
from compile_engine.runtime.structured_output import GrammarCompiler, StructuredOutputs

log = logging.getLogger(__name__)

_DTYPE_NAMES = {"float": "float32", "half": "float16"}  # --dtype's aliases, as the manifest names
_KV_NAMES = {"fp8_e4m3": "fp8"}  # --kv-cache-dtype's aliases


@dataclass(slots=True)
class EngineParts:
    """What `build_engine` hands the engine, complete."""

    config: EngineConfig  # with the artifact's settings filled in
    manifest: Manifest | None  # the artifact's, when starting from one
    loaded: LoadedModel
    tokenizer: object | None
    max_model_len: int
    scheduler: Scheduler
    runner: ModelRunner
    compiled: CompiledForward | None
    # The other tensor-parallel ranks (runtime/parallel.py); None with one rank.
    workers: WorkerGroup | None
    timings: dict[str, float]
    weights_read_s: float
    activation_profile_cached: bool
    structured: StructuredOutputs  # the requests' grammars (runtime/structured_output.py)


Progress = Callable[[str, int, int | None], None]  # (task, done, total): runtime/progress.py


def build_engine(
    config: EngineConfig,
    loaded: LoadedModel | None = None,
    progress: Progress | None = None,
    *,
    proposer: object | None = None,
) -> EngineParts:
    """Build an engine's parts from `config` (an artifact directory or a model), or around an
    already `loaded` model; `progress` hears the weight read, the compile and the CUDA-graph
    capture as they go (`StartupProgress`, for the command line). `proposer` replaces the
    speculative_config method's (the benchmarks' replay proposer, benchmarks/speculative.py:
    not reachable from LLM or the server). Start-up allocates millions
    of objects (modules, Dynamo and Inductor state) and the collector's automatic passes
    traverse them again and again: 0.95 s of a 32-layer model's start-up on the 2-core CPU,
    0.33 s with them paused until the one full collection at the end. Paused for start-up only,
    whatever it raises."""
    collecting = gc.isenabled()
    gc.disable()
    start = _Start(config, progress, proposer)
    try:
        return start.build(loaded)
    except BaseException:
        # A weight read still running when the error ends the process would abort it from
        # native code (`terminate called without an active exception`): end it first.
        start.abandon_weights()
        if start.workers is not None:
            start.workers.shutdown()
        raise
    finally:
        if collecting:
            gc.enable()


class _Start:
    """One start-up's state: the phase timings and the weight read in flight."""

    def __init__(
        self, config: EngineConfig, progress: Progress | None, proposer: object | None
    ) -> None:
        self.config = config
        self.progress = progress
        self.proposer = proposer
        self.t0 = time.perf_counter()
        self.timings: dict[str, float] = {}
        self.weights: WeightRead | None = None
        self.weights_read_s = 0.0
        self.workers: WorkerGroup | None = None

    def phase(self, name: str, since: float) -> None:
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - since

    def build(self, loaded: LoadedModel | None) -> EngineParts:
        config = self.config
        device = config.device
        manifest, model, dtype, cache_dir, passes = self._artifact()
        model_config = None
        if config.tensor_parallel_size > 1:
            if loaded is not None:
                raise EngineConfigError(
                    "tensor_parallel_size > 1 builds each rank's shard itself; pass the model "
                    "path, not a loaded model"
                )
            mark = time.perf_counter()
            model_config = self._start_workers(model, dtype, manifest, cache_dir, passes)
            self.phase("workers_s", mark)
        if loaded is None:
            loaded = self._open(model, dtype, device, manifest, model_config)
        elif config.kv_cache_dtype != "auto":  # a model the caller loaded: this setting's cache
            kv_dtype = check_kv_cache_dtype(loaded.model, config.kv_cache_dtype, loaded.dtype)
            loaded = replace(loaded, kv_cache_dtype=kv_dtype)
        max_model_len = _max_model_len(loaded.config, config.max_model_len)
        mark = time.perf_counter()
        saved = Path(config.model) / SAVED_DIR if manifest is not None else None
        saved_class = manifest.tokenizer_class if manifest is not None else None
        tokenizer = load_tokenizer(loaded.source.kind, loaded.source.path, saved, saved_class)
        self.phase("tokenizer_s", mark)
        compiled = None
        if not config.enforce_eager:
            # Imports Dynamo and Inductor (seconds), while the model gets its storage.
            mark = time.perf_counter()
            compile_config = CompileConfig(
                target=config.target,
                passes=passes,
                cache_dir=cache_dir,
                kernel=KernelConfig.coerce(config.kernel_config),
            )
            compiled = CompiledForward(loaded.model, compile_config, loaded.dtype)
            self.phase("compiler_init_s", mark)
        self.wait_for_weights(storage_only=True)
        reserve, profile_cached = self._activation_reserve(loaded, cache_dir, manifest)
        spec = config.speculative_config
        mark = time.perf_counter()
        draft = load_draft(spec, loaded, device, max_model_len)  # before the pool is sized
        # An EAGLE-3 head makes the target return its aux hidden states: before the capture.
        head = load_head(spec, loaded, device, max_model_len)
        self.phase("draft_model_s", mark)
        mark = time.perf_counter()
        needed_tokens = max_model_len * (config.kv_pool_sequences or config.max_num_seqs)
        num_blocks = config.num_kv_blocks or default_num_blocks(
            loaded,
            config.block_size,
            device,
            needed_tokens,
            reserve,
            config.gpu_memory_utilization,
            max_model_len=max_model_len,
        )
        if self.workers is not None:
            # Every rank's cache has the same blocks (the scheduler's block ids index all).
            num_blocks = self.workers.sizing(
                needed_tokens, reserve, config.num_kv_blocks, num_blocks
            )
        beside = draft or head
        if beside is not None and config.num_kv_blocks is None:
            num_blocks = share_kv_pool(num_blocks, loaded, beside, config.block_size)
        try:
            scheduler = Scheduler(
                SchedulerConfig(
                    max_model_len=max_model_len,
                    block_size=config.block_size,
                    num_blocks=num_blocks,
                    max_num_seqs=config.max_num_seqs,
                    max_num_batched_tokens=config.max_num_batched_tokens,
                    enable_prefix_caching=config.enable_prefix_caching,
                    max_waiting=config.max_waiting,
                    num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                    min_acceptance_rate=spec.min_acceptance_rate if spec else 0.0,
                    acceptance_window=spec.acceptance_window if spec else 16,
                    spec_disable_by_batch_size=spec.disable_by_batch_size if spec else None,
                )
            )
        except InvalidSchedulerConfig as exc:
            raise EngineConfigError(str(exc)) from None
        kv_caches = allocate_kv_caches(loaded, num_blocks, config.block_size, device)
        self.phase("kv_cache_s", mark)
        graphs = None
        if compiled is not None:
            mark = time.perf_counter()
            # The first run of the captured graph waits for the weights: a forward on
            # parameters not yet read could leave NaN in the KV cache's scratch block (which
            # padding reads, masked) or, on CUDA, index out of range.
            compiled.capture(
                kv_caches, before_first_run=self._before_first_run, progress=self.progress
            )
            waited = compiled.backend.stats.before_first_run_seconds
            self.timings["compile_s"] = time.perf_counter() - mark - waited
            if self.workers is not None and config.device.type == "cuda":
                # Not done: a replayed graph would skip the step's broadcast to the workers.
                log.warning("no CUDA graphs: tensor parallelism runs the compiled pieces")
            elif _graphs_possible(config, compiled):
                self.wait_for_weights()  # another thread's copies would break the capture
                mark = time.perf_counter()
                graphs = CUDAGraphRunner.for_compiled(
                    compiled,
                    kv_caches,
                    capture_sizes=default_capture_sizes(
                        config.max_num_seqs,
                        config.max_num_batched_tokens,
                        config.max_cuda_graph_tokens,
                    ),
                    max_num_seqs=config.max_num_seqs,
                    max_model_len=max_model_len,
                    block_size=config.block_size,
                    num_kv_heads=loaded.config.num_kv_heads,
                    device=device,
                )
                graphs.capture(self.progress)
                if head is None:  # an EAGLE-3 / MTP target returns its features beside
                    graphs.capture_heads(
                        logits_and_argmax(compiled.compute_logits), GRAPH_HEAD_MAX_ROWS
                    )
                self.phase("cuda_graphs_s", mark)
        forward, compute_logits = compiled, None
        if self.workers is not None:
            forward = self.workers.forward(compiled or loaded.model.forward)
            compute_logits = self.workers.logits(loaded.model.compute_logits)
        speculator = None
        if spec is not None:
            mark = time.perf_counter()
            eager = config.enforce_eager if spec.enforce_eager is None else spec.enforce_eager
            speculator = build_speculator(
                spec,
                draft,
                num_blocks=num_blocks,
                block_size=config.block_size,
                device=device,
                seed=config.seed,
                compile_config=None
                if eager
                else CompileConfig(config.target, kernel=KernelConfig.coerce(config.kernel_config)),
                head=head,
                target=loaded,
                proposer=self.proposer,
            )
            self.phase("draft_model_s", mark)
        runner = ModelRunner(
            loaded,
            kv_caches,
            block_size=config.block_size,
            num_blocks=num_blocks,
            device=device,
            seed=config.seed,
            forward=forward,
            graphs=graphs,
            compute_logits=compute_logits,
            speculator=speculator,
        )
        self.wait_for_weights()
        # Start-up leaves millions of long-lived objects (modules, Dynamo and Inductor state);
        # a full collection traverses them all and stalls a step by tens of milliseconds (a
        # 0.34 s excess over 127 decode steps at batch 256 on the H200). Freezing moves them
        # out of the collector's sight; garbage made while serving is still collected.
        mark = time.perf_counter()
        gc.collect()
        gc.freeze()
        if torch.device(device).type == "cpu":
            _return_freed_memory()
        self.phase("gc_s", mark)
        self.timings["ready_s"] = time.perf_counter() - self.t0
        log.info(
            "engine ready in %.1f s: %s, %d KV blocks of %d tokens, max_model_len %d",
            self.timings["ready_s"],
            loaded.config.architecture,
            num_blocks,
            config.block_size,
            max_model_len,
        )
        return EngineParts(
            config=config,
            manifest=manifest,
            loaded=loaded,
            tokenizer=tokenizer,
            max_model_len=max_model_len,
            scheduler=scheduler,
            runner=runner,
            compiled=compiled,
            workers=self.workers,
            timings=self.timings,
            weights_read_s=self.weights_read_s,
            activation_profile_cached=profile_cached,
            structured=structured_outputs(config, loaded, tokenizer),
        )

    def _artifact(self) -> tuple[Manifest | None, str, str, Path | None, str | None]:
        """(manifest, model, dtype, compile cache, passes): an artifact fixes the model, dtype,
        target, passes and kernel config it was compiled for, and fills in the engine settings
        it was built with where the caller left them unset."""
        config = self.config
        if not is_artifact(config.model):
            return None, config.model, config.dtype, None, config.passes
        artifact = Path(config.model)
        manifest = Manifest.read(artifact)
        manifest.check(artifact)
        if config.target != manifest.target:
            raise EngineConfigError(
                f"artifact {artifact} was built for target {manifest.target}, not "
                f"{config.target}; {manifest.rebuild_hint(artifact)}"
            )
        if (
            config.dtype != "auto"
            and _DTYPE_NAMES.get(config.dtype, config.dtype) != manifest.dtype
        ):
            raise EngineConfigError(
                f"artifact {artifact} was built for dtype {manifest.dtype}, not {config.dtype}; "
                f"drop --dtype to use the artifact's, or rebuild: "
                f"{manifest.rebuild_hint(artifact).replace(manifest.dtype, config.dtype)}"
            )
        built = manifest.kernel()
        if config.kernel_config is not None and config.kernel_config != built:
            raise EngineConfigError(
                f"artifact {artifact} was built with another kernel config "
                f"({built.to_dict()}); drop kernel_config to use the artifact's, or rebuild it "
                f"with the new one: {manifest.rebuild_hint(artifact)}"
            )
        check_parallel_matches(manifest, artifact, config)
        config.kernel_config = built
        quantization = manifest.engine_args.get("quantization")
        if config.quantization is not None and config.quantization != quantization:
            raise EngineConfigError(
                f"artifact {artifact} was built with quantization={quantization!r}, not "
                f"{config.quantization!r}; drop quantization to use the artifact's, or rebuild"
            )
        config.quantization = quantization
        built_kv = manifest.engine_args.get("kv_cache_dtype", "auto")
        if config.kv_cache_dtype != "auto" and _KV_NAMES.get(
            config.kv_cache_dtype, config.kv_cache_dtype
        ) != _KV_NAMES.get(built_kv, built_kv):
            raise EngineConfigError(
                f"artifact {artifact} was built with kv_cache_dtype={built_kv!r}, not "
                f"{config.kv_cache_dtype!r}; drop kv_cache_dtype to use the artifact's, or "
                f"rebuild with --kv-cache-dtype {config.kv_cache_dtype}"
            )
        config.kv_cache_dtype = built_kv
        model = manifest.model_path
        if manifest.weights_path:
            model = str(artifact / manifest.weights_path)
        if config.max_model_len is None:
            config.max_model_len = manifest.engine_args.get("max_model_len")
        if config.max_cuda_graph_tokens is None:
            config.max_cuda_graph_tokens = manifest.engine_args.get("max_cuda_graph_tokens")
        passes = ",".join(p["name"] for p in manifest.passes)
        self.phase("artifact_check_s", self.t0)
        return manifest, model, manifest.dtype, artifact / "inductor-cache", passes

    def _start_workers(
        self,
        model: str,
        dtype: str,
        manifest: Manifest | None,
        cache_dir: Path | None,
        passes: str | None,
    ) -> ModelConfig:
        """Start the other tensor-parallel ranks (or, launched by torchrun, join them) and
        return the model's config, resolved once here for every rank. A torchrun process of
        rank > 0 serves as a worker and exits when rank 0 ends."""
        config = self.config
        stored = manifest.model_config if manifest is not None else None
        model_config = config_from_dict(stored) if stored else resolve_config(model)
        spec = WorkerSpec(
            model=model,
            dtype=dtype,
            device_type=config.device.type,
            max_model_len=config.max_model_len,
            model_config=config_to_dict(model_config),
            block_size=config.block_size,
            enforce_eager=config.enforce_eager,
            target=config.target,
            passes=passes,
            cache_dir=str(cache_dir) if cache_dir is not None else None,
            kernel_config=KernelConfig.coerce(config.kernel_config).to_dict(),
            expert_parallel=config.enable_expert_parallel,
            timeout_s=config.distributed_timeout_s,
        )
        size = config.tensor_parallel_size
        launch = torchrun_launch(size, backend_for(config.device.type))
        if launch is not None and launch.rank > 0:
            tp, control = init_groups(launch, spec.timeout_s)
            run_worker(launch, tp, control, spec, heartbeat=None)
            raise SystemExit(0)
        self.workers = WorkerGroup.start(spec, size, launch)
        return model_config

    def _before_first_run(self) -> None:
        """The compiled graph's first run computes with the weights, and under tensor
        parallelism meets the other ranks' first run: wait for both."""
        self.wait_for_weights()
        if self.workers is not None:
            self.workers.barrier()

    def _open(
        self,
        model: str,
        dtype: str,
        device: torch.device,
        manifest: Manifest | None,
        model_config: ModelConfig | None = None,
    ) -> LoadedModel:
        """The model with its storage and weights coming on a thread, while this one loads the
        tokenizer, imports the compiler, allocates the KV cache, traces and compiles: sizing
        the KV pool needs the parameters allocated (it reads the free memory), tracing and
        compiling need their addresses, shapes and dtypes, not their values. The read is
        joined before anything computes with the values or a concurrent copy would break it:
        measuring the activation profile, the captured graph's first run, capturing CUDA
        graphs; and at the end of start-up."""
        if device.type == "cuda":
            mark = time.perf_counter()  # the CUDA context, timed apart
            torch.cuda.init()
            torch.cuda.synchronize(device)
            self.phase("cuda_init_s", mark)
        mark = time.perf_counter()
        stored = manifest.model_config if manifest is not None else None
        if model_config is None and stored:
            model_config = config_from_dict(stored)
        loaded, tensors = open_model(
            model,
            dtype=dtype,
            device=device,
            max_model_len=self.config.max_model_len,
            config=model_config,
            storage=False,
            quantization=self.config.quantization,
            parallel=self.workers.tp if self.workers is not None else None,
            kv_cache_dtype=self.config.kv_cache_dtype,
        )
        # Settings the model's config decides, checked before the read starts.
        _max_model_len(loaded.config, self.config.max_model_len)
        self.phase("model_init_s", mark)
        self.weights = WeightRead(loaded.model, tensors, device, self.progress)
        return loaded

    def abandon_weights(self) -> None:
        """Let a weight read that is still running end, whatever it raises: start-up failed
        already, and its error is the one to report."""
        if self.weights is not None:
            self.weights.join()
            self.weights = None

    def wait_for_weights(self, storage_only: bool = False) -> None:
        """Wait for the weight read (or, `storage_only`, for the model's storage), if one
        runs; waiting is a phase of its own."""
        if self.weights is None:
            return
        mark = time.perf_counter()
        if storage_only:
            self.weights.wait_for_storage()
        else:
            self.weights.wait()
        self.phase("weights_wait_s", mark)
        if not storage_only:
            self.weights_read_s = self.weights.seconds
            self.weights = None

    def _activation_reserve(
        self, loaded: LoadedModel, cache_dir: Path | None, manifest: Manifest | None
    ) -> tuple[int, bool]:
        """(bytes the KV pool leaves free for activations, whether the peak came from the
        cache): on CUDA with the pool sized from memory, the largest step's activations twice,
        once for eager/compiled steps and once for the CUDA graph pool (captured largest first,
        it is one graph's worth). Usually measured by the build; measuring here needs the
        weights read."""
        config = self.config
        if config.device.type != "cuda" or config.num_kv_blocks is not None:
            return 0, False
        mark = time.perf_counter()
        gc.collect()  # no cyclic garbage holding device memory while the pool is sized
        key = dict(
            cache_dir=cache_dir,
            device_name=device_description(config.target),
            code=manifest.code_hash if manifest is not None else "",
        )
        sizes = (loaded, config.max_num_batched_tokens, config.max_num_seqs)
        peak = lookup_activation_bytes(*sizes, **key)
        self.phase("activation_profile_s", mark)
        cached = peak is not None
        if peak is None:
            self.wait_for_weights()
            mark = time.perf_counter()
            peak, _ = activation_bytes(*sizes, **key)
            self.phase("activation_profile_s", mark)
        return 2 * peak, cached


def check_parallel_matches(manifest: Manifest, artifact: Path, config: EngineConfig) -> None:
    """An artifact holds the compiled shards of the rank count (and expert split) it was built
    for: refuse to serve it with others, saying how to serve or rebuild it."""
    args = manifest.engine_args
    built = (args.get("tensor_parallel_size", 1), bool(args.get("enable_expert_parallel")))
    wanted = (config.tensor_parallel_size, config.enable_expert_parallel)
    if built == wanted:
        return
    flags = " --enable-expert-parallel" if wanted[1] else ""
    hint = manifest.rebuild_hint(artifact).split(" --out ")[0]
    for flag in (f" --tensor-parallel-size {built[0]}", " --enable-expert-parallel"):
        hint = hint.replace(flag, "")
    raise EngineConfigError(
        f"artifact {artifact} was built for tensor_parallel_size={built[0]}"
        f"{', expert parallel' if built[1] else ''}, not tensor_parallel_size={wanted[0]}"
        f"{', expert parallel' if wanted[1] else ''}; serve it with the settings it was built "
        f"for, or {hint} --tensor-parallel-size {wanted[0]}{flags} --out {artifact}"
    )


def _return_freed_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim): start-up's
    temporaries (the GGUF read and repack, Inductor's compiles) leave ~60 MB free but resident
    in the heap and the reading thread's arena (SmolLM2 on the CPU: 982 -> 921 MB)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _graphs_possible(config: EngineConfig, compiled: CompiledForward) -> bool:
    """CUDA graphs need a device and a graph without host synchronisation: no op left on a
    reference that reads device values on the host (attention's reads sequence lengths, the
    MoE grouped GEMM's the experts present), only their kernel lowerings."""
    if config.device.type != "cuda" or not config.cuda_graphs:
        return False
    blocking = compiled.backend.stats.host_sync_ops
    if blocking:
        log.info("no CUDA graphs: %s run on host-synchronising references", blocking)
    return not blocking


def _max_model_len(cfg: ModelConfig, requested: int | None) -> int:
    limit = cfg.max_position_embeddings
    if cfg.sliding_window is not None and cfg.sliding_window < limit:
        # The reference attention is full attention; within the window the two agree.
        log.info("max_model_len capped at the sliding window, %d", cfg.sliding_window)
        limit = cfg.sliding_window
    if requested is None:
        return limit
    if requested > limit:
        raise EngineConfigError(
            f"max_model_len={requested} exceeds what the model supports ({limit})"
        )
    return requested


def structured_outputs(
    config: EngineConfig, loaded: LoadedModel, tokenizer: object | None
) -> StructuredOutputs:
    """The grammar state of an engine: a compiler for the model's vocabulary (llguidance's view
    of it is built on the first grammar, not here) and the reasoning parser, if any."""
    compiler = GrammarCompiler(
        tokenizer,
        loaded.config.vocab_size,
        list(loaded.config.eos_token_ids),
        timeout_s=config.grammar_compile_timeout_s,
    )
    parser = None
    if config.reasoning_parser is not None:
        parser = reasoning_parser(config.reasoning_parser)
    return StructuredOutputs(compiler, reasoning=parser)
