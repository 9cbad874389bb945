"""The engine loop: scheduler -> runner -> scheduler update -> detokenize, once per step.

`LLMEngine.step()` is the whole serving loop body; `LLM` (runtime/llm.py) drives it to
completion for offline use and the server drives it from a background task.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from compile_engine.compiler.artifact import Manifest, device_description, is_artifact
from compile_engine.compiler.compiled_model import CompiledForward
from compile_engine.compiler.config import CompileConfig
from compile_engine.compiler.cuda_graphs import CUDAGraphRunner, default_capture_sizes
from compile_engine.kernels_generated.tuning import KernelConfig, KernelConfigError
from compile_engine.models.config import ModelConfig, config_from_dict
from compile_engine.models.loader import LoadedModel, WeightRead, open_model
from compile_engine.models.tokenizer import SAVED_DIR, load_tokenizer
from compile_engine.runtime.activation_profile import activation_bytes
from compile_engine.runtime.activation_profile import lookup as lookup_activation_bytes
from compile_engine.runtime.detokenizer import IncrementalDetokenizer
from compile_engine.runtime.model_runner import (
    InFlightStep,
    ModelRunner,
    TokenLogprobs,
    default_num_blocks,
)
from compile_engine.runtime.request import Request, RequestStatus
from compile_engine.runtime.sampling_params import SamplingParams
from compile_engine.runtime.scheduler import Scheduler, SchedulerConfig, SchedulerStats

log = logging.getLogger(__name__)

TARGETS = {"cpu": "cpu", "h100": "cuda"}


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
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise EngineConfigError(f"{name}={value!r} is invalid: must be an integer >= 1")
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
        if self.kernel_config is not None:
            try:
                self.kernel_config = KernelConfig.coerce(self.kernel_config)
            except KernelConfigError as exc:
                raise EngineConfigError(f"kernel_config: {exc}") from None

    @property
    def device(self) -> torch.device:
        return torch.device(TARGETS[self.target])


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    # What this step added, for streaming.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool


@dataclass(slots=True)
class _Sequence:
    """Engine-side state of one sibling: its scheduler request and its text."""

    request: Request
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[TokenLogprobs] | None
    delta_text: str = ""
    delta_tokens: list[int] = field(default_factory=list)
    finished_seen: bool = False


@dataclass(slots=True)
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_Sequence]
    arrival_time: float

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.sequences)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        # Start-up allocates millions of objects (modules, Dynamo and Inductor state) and the
        # collector's automatic passes traverse them again and again: 0.95 s of a 32-layer
        # model's start-up on the 2-core CPU, 0.33 s with them paused until the one full
        # collection at the end of start-up. Paused for start-up only, whatever it raises.
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._start(config, loaded)
        finally:
            if collecting:
                gc.enable()

    def _start(self, config: EngineConfig, loaded: LoadedModel | None) -> None:
        self.config = config
        device = config.device
        t0 = time.perf_counter()
        # Start-up phases of this thread, disjoint, in order, summing to ready_s; bench
        # startup reports them. The weight read runs beside them (`weights_read_s`); issue
        # 7's target bounds ready_s by 10 s plus that read.
        self.timings: dict[str, float] = {}
        model, dtype, cache_dir, passes = config.model, config.dtype, None, config.passes
        self.manifest: Manifest | None = None
        if is_artifact(config.model):
            # An artifact fixes the model, dtype, target and passes it was compiled for.
            artifact = Path(config.model)
            self.manifest = manifest = Manifest.read(artifact)
            manifest.check(artifact)
            if config.target != manifest.target:
                raise EngineConfigError(
                    f"artifact {artifact} was built for target {manifest.target}, not "
                    f"{config.target}; {manifest.rebuild_hint(artifact)}"
                )
            model, dtype = manifest.model_path, manifest.dtype
            if manifest.weights_path:
                model = str(artifact / manifest.weights_path)
            cache_dir = artifact / "inductor-cache"
            passes = ",".join(p["name"] for p in manifest.passes)
            built = manifest.kernel()
            if config.kernel_config is not None and config.kernel_config != built:
                raise EngineConfigError(
                    f"artifact {artifact} was built with another kernel config "
                    f"({built.to_dict()}); drop kernel_config to use the artifact's, or "
                    f"rebuild it with the new one: {manifest.rebuild_hint(artifact)}"
                )
            config.kernel_config = built
            if config.max_model_len is None:
                config.max_model_len = manifest.engine_args.get("max_model_len")
            if config.max_cuda_graph_tokens is None:
                config.max_cuda_graph_tokens = manifest.engine_args.get("max_cuda_graph_tokens")
            self.timings["artifact_check_s"] = time.perf_counter() - t0
        # The weight read's own duration; with the read on a thread (below) it overlaps the
        # phases, which count only the main thread's wait for it (`weights_wait_s`).
        self.weights_read_s = 0.0
        self._weights: WeightRead | None = None
        if loaded is None:
            self._init_cuda(device)
            mark = time.perf_counter()
            stored = self.manifest.model_config if self.manifest is not None else None
            loaded, tensors = open_model(
                model,
                dtype=dtype,
                device=device,
                max_model_len=config.max_model_len,
                config=config_from_dict(stored) if stored else None,
                storage=False,
            )
            self.timings["model_init_s"] = time.perf_counter() - mark
            # The model gets its storage and weights on a thread while this one loads the
            # tokenizer, imports the compiler, allocates the KV cache, traces and compiles.
            # Sizing the KV pool needs the parameters allocated (it reads the free memory),
            # tracing and compiling need their addresses, shapes and dtypes, not their values.
            # The read is joined before anything computes with the values or a concurrent
            # copy would break it: measuring the activation profile, the captured graph's
            # first run, capturing CUDA graphs; and at the end of start-up.
            self._weights = WeightRead(loaded.model, tensors, device)
        self.loaded = loaded
        self.model_config: ModelConfig = loaded.config
        self.max_model_len = self._max_model_len(loaded.config, config.max_model_len)
        saved = Path(config.model) / SAVED_DIR if self.manifest is not None else None
        mark = time.perf_counter()
        saved_class = self.manifest.tokenizer_class if self.manifest is not None else None
        self.tokenizer = load_tokenizer(loaded.source.kind, loaded.source.path, saved, saved_class)
        self.timings["tokenizer_s"] = time.perf_counter() - mark
        self.compiled: CompiledForward | None = None
        if not config.enforce_eager:
            # Imports Dynamo and Inductor (seconds), while the model gets its storage.
            mark = time.perf_counter()
            compile_config = CompileConfig(
                target=config.target,
                passes=passes,
                cache_dir=cache_dir,
                kernel=KernelConfig.coerce(config.kernel_config),
            )
            self.compiled = CompiledForward(loaded.model, compile_config, loaded.dtype)
            self.timings["compiler_init_s"] = time.perf_counter() - mark
        self._wait_for_weights(storage_only=True)
        reserve = 0
        self.activation_profile_cached = False
        if device.type == "cuda" and config.num_kv_blocks is None:
            mark = time.perf_counter()
            gc.collect()  # no cyclic garbage holding device memory while the pool is sized
            # Activations of the largest step, twice: once for eager/compiled steps and once
            # for the CUDA graph pool (captured largest first, it is one graph's worth).
            # Usually measured by the build; measuring here needs the weights read.
            key = dict(
                cache_dir=cache_dir,
                device_name=device_description(config.target),
                code=self.manifest.code_hash if self.manifest is not None else "",
            )
            sizes = (loaded, config.max_num_batched_tokens, config.max_num_seqs)
            peak = lookup_activation_bytes(*sizes, **key)
            self.activation_profile_cached = peak is not None
            self.timings["activation_profile_s"] = time.perf_counter() - mark
            if peak is None:
                self._wait_for_weights()
                mark = time.perf_counter()
                peak, _ = activation_bytes(*sizes, **key)
                self.timings["activation_profile_s"] += time.perf_counter() - mark
            reserve = 2 * peak
        mark = time.perf_counter()
        num_blocks = config.num_kv_blocks or default_num_blocks(
            loaded,
            config.block_size,
            device,
            self.max_model_len * (config.kv_pool_sequences or config.max_num_seqs),
            reserve,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_model_len=self.max_model_len,
                block_size=config.block_size,
                num_blocks=num_blocks,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                enable_prefix_caching=config.enable_prefix_caching,
                max_waiting=config.max_waiting,
            )
        )
        self.runner = ModelRunner(
            loaded,
            block_size=config.block_size,
            num_blocks=num_blocks,
            device=device,
            seed=config.seed,
        )
        self.timings["kv_cache_s"] = time.perf_counter() - mark
        if self.compiled is not None:
            mark = time.perf_counter()
            # The first run of the captured graph waits for the weights: a forward on
            # parameters not yet read could leave NaN in the KV cache's scratch block (which
            # padding reads, masked) or, on CUDA, index out of range.
            self.compiled.capture(self.runner.kv_caches, before_first_run=self._wait_for_weights)
            waited = self.compiled.backend.stats.before_first_run_seconds
            self.timings["compile_s"] = time.perf_counter() - mark - waited
            self.runner.forward = self.compiled
            if self._graphs_possible():
                self._wait_for_weights()  # another thread's copies would break the capture
                mark = time.perf_counter()
                self.runner.graphs = CUDAGraphRunner.for_compiled(
                    self.compiled,
                    self.runner.kv_caches,
                    capture_sizes=default_capture_sizes(
                        config.max_num_seqs,
                        config.max_num_batched_tokens,
                        config.max_cuda_graph_tokens,
                    ),
                    max_num_seqs=config.max_num_seqs,
                    max_model_len=self.max_model_len,
                    block_size=config.block_size,
                    num_kv_heads=self.model_config.num_kv_heads,
                    device=device,
                )
                self.runner.graphs.capture()
                self.timings["cuda_graphs_s"] = time.perf_counter() - mark
        self._wait_for_weights()
        # Start-up leaves millions of long-lived objects (modules, Dynamo and Inductor state);
        # a full collection traverses them all and stalls a step by tens of milliseconds (a
        # 0.34 s excess over 127 decode steps at batch 256 on the H200). Freezing moves them
        # out of the collector's sight; garbage made while serving is still collected.
        mark = time.perf_counter()
        gc.collect()
        gc.freeze()
        self.timings["gc_s"] = time.perf_counter() - mark
        self.timings["ready_s"] = time.perf_counter() - t0
        eos = loaded.config.eos_token_ids
        self.eos_token_id = eos[0] if eos else getattr(self.tokenizer, "eos_token_id", None)
        self.groups: dict[str, _Group] = {}
        self._seq_of: dict[str, tuple[_Group, _Sequence]] = {}
        self._counter = 0
        self._in_flight: InFlightStep | None = None
        self._needs_history: set[str] = set()  # live groups whose sampling reads past tokens
        log.info(
            "engine ready in %.1f s: %s, %d KV blocks of %d tokens, max_model_len %d",
            time.perf_counter() - t0,
            loaded.config.architecture,
            num_blocks,
            config.block_size,
            self.max_model_len,
        )

    def _init_cuda(self, device: torch.device) -> None:
        """The CUDA context, timed apart (the first call that needs it creates it)."""
        if device.type == "cuda":
            mark = time.perf_counter()
            torch.cuda.init()
            torch.cuda.synchronize(device)
            self.timings["cuda_init_s"] = time.perf_counter() - mark

    def _wait_for_weights(self, storage_only: bool = False) -> None:
        """Wait for the weight read (or, `storage_only`, for the model's storage), if one
        runs; waiting is a phase of its own."""
        if self._weights is None:
            return
        mark = time.perf_counter()
        if storage_only:
            self._weights.wait_for_storage()
        else:
            self._weights.wait()
        waited = time.perf_counter() - mark
        self.timings["weights_wait_s"] = self.timings.get("weights_wait_s", 0.0) + waited
        if not storage_only:
            self.weights_read_s = self._weights.seconds
            self._weights = None

    def _graphs_possible(self) -> bool:
        """CUDA graphs need a device and a graph without host synchronisation: no op left on
        a reference that reads device values on the host (attention's reads sequence lengths,
        the MoE grouped GEMM's the experts present), only their kernel lowerings."""
        if self.config.device.type != "cuda" or self.compiled is None:
            return False
        if not self.config.cuda_graphs:
            return False
        blocking = self.compiled.backend.stats.host_sync_ops
        if blocking:
            log.info("no CUDA graphs: %s run on host-synchronising references", blocking)
        return not blocking

    @staticmethod
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

    # -- requests -----------------------------------------------------------------------------

    def next_request_id(self) -> str:
        self._counter += 1
        return str(self._counter)

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids instead")
            try:
                prompt.encode()  # a lone UTF-16 surrogate is a str but not text
            except UnicodeEncodeError as exc:
                raise ValueError(
                    f"the prompt is not valid Unicode ({exc.reason} at index {exc.start}); "
                    "pass text without unpaired surrogates"
                ) from None
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=True))
        return None, [int(t) for t in prompt]

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request (n siblings for n > 1). Raises the scheduler's typed errors
        (RequestTooLong, QueueFull, DuplicateRequest) without queuing anything."""
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in flight")
        text, token_ids = self.tokenize(prompt)
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        now = time.monotonic()
        sequences = []
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            request = Request(
                request_id=rid,
                prompt_token_ids=token_ids,
                sampling_params=params,
                eos_token_id=self.eos_token_id,
                arrival_time=now,
                cache_salt=cache_salt,
                group_id=request_id if params.n > 1 else None,
                sibling_index=i,
            )
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, token_ids, params)
            logprobs = [] if params.logprobs is not None else None
            sequences.append(_Sequence(request, detok, logprobs))
        added = []
        try:
            for seq in sequences:
                self.scheduler.add_request(seq.request)
                added.append(seq.request.request_id)
        except Exception:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise
        group = _Group(request_id, text, token_ids, sequences, now)
        self.groups[request_id] = group
        if params.needs_output_history:
            self._needs_history.add(request_id)
        for seq in sequences:
            self._seq_of[seq.request.request_id] = (group, seq)

    def abort_request(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        self._needs_history.discard(request_id)
        ids = [s.request.request_id for s in group.sequences]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for rid in ids:
            self._seq_of.pop(rid, None)
            self.runner.release(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups) or self._in_flight is not None

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    # -- the loop -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; return the outputs of every request that changed.

        With async scheduling one step stays in flight: this call schedules and launches step
        N+1 (its pending tokens come from step N on the device), then waits for step N's
        tokens and processes them, so the host's work overlaps the device's. The outputs are
        therefore one step behind the launches; the tokens are the same.
        """
        started = time.perf_counter()
        outputs: list[RequestOutput] = []
        previous, self._in_flight = self._in_flight, None
        if previous is not None and not self._overlap():
            outputs, previous = self._process(previous), None
        step = self.scheduler.schedule()
        launched = self.runner.launch(step, previous) if step.scheduled else None
        if previous is not None:
            outputs = self._process(previous)
        if launched is not None:
            if self._overlap():
                self._in_flight = launched
            else:
                outputs += self._process(launched)
        self.runner.counters.busy_s += time.perf_counter() - started
        return outputs

    def _overlap(self) -> bool:
        return self.config.async_scheduling and not self._needs_history

    def _process(self, flight: InFlightStep) -> list[RequestOutput]:
        """Deliver a launched step's tokens: scheduler update, stop strings, text."""
        step = flight.step
        result = self.runner.collect(flight)
        self.scheduler.update_from_output(step, result.sampled)
        changed: dict[str, _Group] = {}
        for rid, token in result.sampled.items():
            entry = self._seq_of.get(rid)
            if entry is None:
                continue
            group, seq = entry
            changed[group.request_id] = group
            seq.delta_tokens.append(token)
            if seq.logprobs is not None and rid in result.logprobs:
                seq.logprobs.append(result.logprobs[rid])
            if seq.detokenizer is not None:
                seq.delta_text += seq.detokenizer.update([token])
                if seq.detokenizer.stopped and not seq.request.is_finished:
                    self.scheduler.finish_requests(
                        rid, RequestStatus.FINISHED_STOPPED, seq.detokenizer.stop_reason
                    )
        for item in step.scheduled:
            # Requests finished by the scheduler this step (eos, length) flush held-back text.
            entry = self._seq_of.get(item.request.request_id)
            if entry is not None and item.request.is_finished:
                changed[entry[0].request_id] = entry[0]
        return [self._emit(group) for group in changed.values()]

    def _emit(self, group: _Group) -> RequestOutput:
        outputs = []
        for i, seq in enumerate(group.sequences):
            request = seq.request
            if request.is_finished and not seq.finished_seen:
                seq.finished_seen = True
                self.runner.release(request.request_id)
                if seq.detokenizer is not None and not seq.detokenizer.stopped:
                    seq.delta_text += seq.detokenizer.flush()
            text = seq.detokenizer.text if seq.detokenizer is not None else ""
            outputs.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=list(request.output_token_ids),
                    finish_reason=request.finish_reason,
                    stop_reason=request.stop_reason,
                    logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                    delta_text=seq.delta_text,
                    delta_token_ids=seq.delta_tokens,
                )
            )
            seq.delta_text, seq.delta_tokens = "", []
        finished = group.finished
        if finished:
            self.groups.pop(group.request_id, None)
            self._needs_history.discard(group.request_id)
            for seq in group.sequences:
                self._seq_of.pop(seq.request.request_id, None)
        return RequestOutput(
            group.request_id, group.prompt, group.prompt_token_ids, outputs, finished
        )
