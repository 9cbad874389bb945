"""`compile-engine build`: load, trace, run passes, compile, write the artifact.

Build runs on a machine of the target (CPU for `cpu`, an H100/H200 for `h100`): Inductor
tunes and compiles for the hardware it runs on.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from compile_engine.compiler.artifact import (
    Manifest,
    code_hash,
    device_description,
    model_fingerprint,
    versions,
)
from compile_engine.compiler.compiled_model import CompiledForward
from compile_engine.compiler.config import CompileConfig
from compile_engine.compiler.cuda_graphs import (
    MAX_GRAPH_TOKENS,
    CUDAGraphRunner,
    default_capture_sizes,
)
from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.tuning import KernelConfig
from compile_engine.models.config import config_to_dict
from compile_engine.models.loader import LoadedModel, export_hf_checkpoint, load_model
from compile_engine.models.parallel import TensorParallel
from compile_engine.models.quant import quantized_layers
from compile_engine.models.tokenizer import SAVED_DIR, load_tokenizer, tokenizer_class_name

log = logging.getLogger(__name__)

# A step the caller adds to the build, run once the model is compiled, given the loaded model
# and the artifact directory: how the runtime (which compiler/ never imports) stores what a
# serve would otherwise measure at every first start (runtime/activation_profile.py).
BuildStep = Callable[[LoadedModel, Path], None]

CACHE_SUBDIR = "inductor-cache"
WEIGHTS_SUBDIR = "weights"
KERNELS_SUBDIR = "kernels"


def _generated_modules() -> set[str]:
    """Files of the Python modules Inductor has generated and loaded in this process."""
    from torch._inductor.codecache import PyCodeCache

    return {m.__file__ for m in PyCodeCache.modules if getattr(m, "__file__", None)}


def prepare_output(out: str | Path) -> Path:
    """The artifact directory, emptied of an earlier artifact (anything else there is an
    error), with its kernels/ folder."""
    out = Path(out).resolve()
    if out.exists() and any(out.iterdir()):
        if not (out / "manifest.json").is_file():
            raise FileExistsError(f"{out} exists and is not an artifact; choose another --out")
        shutil.rmtree(out)
    (out / KERNELS_SUBDIR).mkdir(parents=True)
    return out


def compile_shard(
    model: str,
    out: str | Path,
    *,
    parallel: TensorParallel,
    target: str = "cpu",
    dtype: str = "auto",
    max_model_len: int | None = None,
    block_size: int = 16,
    passes: str | None = None,
    kernel_config: dict | None = None,
    before_first_run: Callable[[], None] | None = None,
) -> None:
    """What a tensor-parallel build runs on each rank but 0: load the rank's shard and compile
    it into the artifact's Inductor cache (rank 0's `build_artifact` writes the rest). Each
    rank's graph differs (its vocabulary and expert offsets are constants in it), so each
    compiles its own pieces, which a serve of that rank then finds."""
    out = Path(out)
    device = torch.device("cuda", parallel.rank) if target == "h100" else torch.device("cpu")
    loaded = load_model(
        model, dtype=dtype, device=device, max_model_len=max_model_len, parallel=parallel
    )
    shape = loaded.model.kv_cache_shape(2, block_size)
    kv_caches = [
        torch.zeros(shape, dtype=loaded.dtype, device=device)
        for _ in range(loaded.config.num_layers)
    ]
    config = CompileConfig(
        target=target,
        passes=passes,
        cache_dir=out / CACHE_SUBDIR,
        kernel=KernelConfig.from_dict(kernel_config) if kernel_config else tuning.default(),
    )
    CompiledForward(loaded.model, config, loaded.dtype).capture(
        kv_caches, before_first_run=before_first_run
    )


def build_artifact(
    model: str,
    out: str | Path,
    *,
    target: str = "cpu",
    dtype: str = "auto",
    max_model_len: int | None = None,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
    max_cuda_graph_tokens: int | None = None,
    block_size: int = 16,
    passes: str | None = None,
    kernel_config: KernelConfig | None = None,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    progress: Callable[[str, float], None] | None = None,
    steps: Callable[[str, int, int | None], None] | None = None,
    extra_steps: dict[str, BuildStep] | None = None,
    parallel: TensorParallel | None = None,
    before_first_run: Callable[[], None] | None = None,
) -> Manifest:
    """Compile `model` for `target` into the artifact directory `out`; return its manifest.
    max_cuda_graph_tokens (None: MAX_GRAPH_TOKENS) bounds the graph sizes warmed up here, so
    that serve's graphs of the same bound find their kernels in the artifact. kernel_config:
    our kernels' launch choices (None: the defaults), recorded in the manifest. quantization:
    None or "fp8" (online FP8, models/quant.py); the manifest lists the quantized layers.
    kv_cache_dtype: "auto" or "fp8" (an e4m3 KV cache, models/ops.py), in the manifest and its
    cache key: the graph is traced and warmed up over caches of that dtype.
    progress hears each stage's time when it ends; steps the compile's pieces and the warm-up's
    sizes as they go (task, done, total). parallel: build rank 0's shard of a tensor-parallel
    artifact, whose other ranks run `compile_shard` meanwhile (runtime/parallel.py
    `build_parallel` starts them and prepares `out`); before_first_run meets them before the
    graph's first run, whose collectives need every rank."""
    kernel_config = kernel_config or tuning.default()
    max_cuda_graph_tokens = max_cuda_graph_tokens or MAX_GRAPH_TOKENS
    say = progress or (lambda stage, seconds: log.info("%-8s %6.1f s", stage, seconds))
    out = prepare_output(out) if parallel is None else Path(out).resolve()
    device = torch.device("cuda" if target == "h100" else "cpu")
    t0 = time.perf_counter()

    loaded = load_model(
        model,
        dtype=dtype,
        device=device,
        max_model_len=max_model_len,
        quantization=quantization,
        parallel=parallel,
        kv_cache_dtype=kv_cache_dtype,
    )
    t_load = time.perf_counter() - t0
    say("load", t_load)

    cfg = loaded.config
    # Capture needs a cache to write into, not a real-sized one: one scratch block per layer.
    shape = loaded.model.kv_cache_shape(2, block_size)
    kv_caches = [
        torch.zeros(shape, dtype=loaded.cache_dtype, device=device) for _ in range(cfg.num_layers)
    ]
    config = CompileConfig(
        target=target, passes=passes, cache_dir=out / CACHE_SUBDIR, kernel=kernel_config
    )
    compiled = CompiledForward(loaded.model, config, loaded.dtype)
    before = _generated_modules()
    compiled.capture(kv_caches, before_first_run=before_first_run, progress=steps)
    stats = compiled.backend.stats
    say("trace+passes", stats.trace_seconds + stats.pass_seconds)
    say("compile", stats.seconds - stats.pass_seconds)

    kernels = []
    for path in sorted(_generated_modules() - before):
        dest = out / KERNELS_SUBDIR / Path(path).name
        shutil.copyfile(path, dest)
        kernels.append(str(dest.relative_to(out)))

    # Not done: CUDA graphs under tensor parallelism (runtime/builder.py serves without them).
    capture_sizes = (
        default_capture_sizes(max_num_seqs, max_num_batched_tokens, max_cuda_graph_tokens)
        if target == "h100" and parallel is None
        else []
    )
    warm_up_s = 0.0
    if capture_sizes and not stats.host_sync_ops:
        # Serve captures a CUDA graph per size, and a size's first launch may compile Triton
        # specialisations (paged attention's split count follows the token count). Compiled
        # here, they land in the artifact's Triton cache and serve only loads them: the H200
        # startup run at d3580b3 spent 6.5 s capturing graphs, a later load of the same
        # artifact (its Triton cache filled by the first) 1.1 s. Shapes as serve will have
        # them: its block tables span max_model_len, as the engine defaults it.
        model_len = cfg.max_position_embeddings
        if cfg.sliding_window is not None:
            model_len = min(model_len, cfg.sliding_window)
        model_len = max_model_len or model_len
        runner = CUDAGraphRunner.for_compiled(
            compiled,
            kv_caches,
            capture_sizes=capture_sizes,
            max_num_seqs=max_num_seqs,
            max_model_len=model_len,
            block_size=block_size,
            num_kv_heads=cfg.num_kv_heads,
            device=device,
        )
        runner.warm_up(steps)
        warm_up_s = runner.warmup_seconds
        say("warm-up", warm_up_s)

    extra_s = {}
    if parallel is not None and extra_steps:
        # A step computing with rank 0's shard alone would wait forever on the other ranks.
        raise ValueError("extra build steps cannot run on one rank of a tensor-parallel build")
    for name, step in (extra_steps or {}).items():
        mark = time.perf_counter()
        step(loaded, out)
        extra_s[f"{name}_s"] = round(time.perf_counter() - mark, 2)
        say(name, extra_s[f"{name}_s"])

    weights_path = None
    if loaded.source.kind == "gguf" and loaded.quant is None:
        # GGUF needs parsing and dequantisation at every load; the artifact keeps the result
        # (whole, under tensor parallelism too: each rank of a serve reads its slices of it).
        # Kept quantized, it loads from the file itself (the blocks are read, not converted).
        # (An explicit dtype: a whole GGUF read with "auto" would stay quantized.)
        shard_dtype = str(loaded.dtype).removeprefix("torch.")
        whole = loaded.model if parallel is None else load_model(model, dtype=shard_dtype).model
        export_hf_checkpoint(whole, loaded.hf_config, out / WEIGHTS_SUBDIR)
        weights_path = WEIGHTS_SUBDIR
    tokenizer = load_tokenizer(loaded.source.kind, loaded.source.path)
    tokenizer_class = None
    if tokenizer is not None:
        tokenizer.clean_up_tokenization_spaces = False  # ignored for BPE; warns if left set
        tokenizer.save_pretrained(str(out / SAVED_DIR))
        # What a load of the saved tokenizer resolves to, so that loads skip the resolving.
        tokenizer_class = tokenizer_class_name(load_tokenizer("hf", out / SAVED_DIR))

    manifest = Manifest(
        model_path=str(loaded.source.path.resolve()),
        model_kind=loaded.source.kind,
        model_fingerprint=model_fingerprint(loaded.source.path),
        weights_path=weights_path,
        architecture=cfg.architecture,
        dtype=str(loaded.dtype).removeprefix("torch."),
        target=target,
        device=device_description(target),
        code_hash=code_hash(),
        versions=versions(),
        engine_args=dict(
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_cuda_graph_tokens=max_cuda_graph_tokens,
            block_size=block_size,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            # The shards were compiled for this many ranks (each its own graph): a serve
            # must run as many (runtime/builder.py checks).
            tensor_parallel_size=parallel.world_size if parallel is not None else 1,
            enable_expert_parallel=parallel is not None and parallel.expert_parallel,
        ),
        passes=compiled.pass_manager.describe(),
        pass_manager_uuid=compiled.pass_manager.uuid(),
        compile=stats.as_dict(),
        kernels=kernels,
        # CUDA graphs cannot be serialised: serve captures these sizes at start.
        capture_sizes=capture_sizes,
        model_config=config_to_dict(cfg),
        tokenizer_class=tokenizer_class,
        kernel_config=kernel_config.describe(),
        quantization=quantized_layers(loaded.model, loaded.quant),
        kv_cache_dtype=str(loaded.cache_dtype).removeprefix("torch."),
        timings=dict(
            load_s=round(t_load, 2),
            trace_and_passes_s=round(stats.trace_seconds + stats.pass_seconds, 2),
            compile_s=round(stats.seconds - stats.pass_seconds, 2),
            warm_up_s=round(warm_up_s, 2),
            **extra_s,
            total_s=round(time.perf_counter() - t0, 2),
        ),
    )
    manifest.write(out)
    say("total", time.perf_counter() - t0)
    return manifest
