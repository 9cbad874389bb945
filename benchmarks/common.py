"""What the engine benchmarks share: engine flags, random token-id prompts, honest clocks."""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from compile_engine.benchmarks.results import DEFAULT_DIRECTORY
from compile_engine.runtime.engine_args import add_engine_options
from compile_engine.runtime.engine_args import engine_kwargs as engine_kwargs  # the flags' map


def add_engine_flags(
    p: argparse.ArgumentParser,
    *,
    max_num_seqs: int | None = 256,
    max_num_batched_tokens: int = 2048,
) -> None:
    """The LLM(...) settings a benchmark passes through, plus where its JSON goes."""
    p.add_argument("--model", required=True, help="HF directory (see bench make-model)")
    add_engine_options(p, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    p.add_argument("--results-dir", default=str(DEFAULT_DIRECTORY), help="where the JSON goes")


def engine_settings(llm) -> dict:
    """The engine as it was actually built (defaults resolved), for the JSON."""
    cfg = llm.engine.config
    sched = llm.engine.scheduler.config
    return {
        "target": cfg.target,
        "dtype": str(llm.engine.loaded.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(llm.engine.loaded.cache_dtype).removeprefix("torch."),
        "block_size": cfg.block_size,
        "num_kv_blocks": sched.num_blocks,
        "max_model_len": sched.max_model_len,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "enforce_eager": cfg.enforce_eager,
        "async_scheduling": cfg.async_scheduling,
        "speculative_config": cfg.speculative_config.to_dict() if cfg.speculative_config else None,
        "compiled": llm.engine.compiled is not None,
        "compile": llm.engine.compiled.backend.stats.as_dict() if llm.engine.compiled else None,
        "passes": llm.engine.compiled.pass_manager.describe() if llm.engine.compiled else None,
        # What our kernels launched with: the settings, the key, each table's file and hash.
        "kernel_config": llm.engine.compiled.config.kernel.describe()
        if llm.engine.compiled
        else None,
        "cuda_graphs": _graph_summary(llm.engine.runner.graphs),
        # FP8 (models/quant.py): method, scheme, scale kinds; None in the model dtype.
        "quantization": llm.engine.loaded.quant.describe() if llm.engine.loaded.quant else None,
    }


def _graph_summary(graphs) -> dict | None:
    if graphs is None:
        return None
    return {
        "num_graphs": len(graphs.graphs),
        "capture_sizes": graphs.sizes,
        "short_context_widths": graphs.short_widths,
        "capture_seconds": round(graphs.capture_seconds, 2),
        "pool_gib": round(graphs.pool_bytes / 2**30, 3),
    }


def model_summary(llm) -> dict:
    mc = llm.engine.model_config
    return {
        "architecture": mc.architecture,
        "num_layers": mc.num_layers,
        "hidden_size": mc.hidden_size,
        "intermediate_size": mc.intermediate_size,
        "num_heads": mc.num_heads,
        "num_kv_heads": mc.num_kv_heads,
        "head_dim": mc.head_dim,
        "vocab_size": mc.vocab_size,
    }


def random_prompts(
    n: int, lengths: int | list[int], vocab_size: int, rng: random.Random
) -> list[list[int]]:
    """Token-id prompts drawn uniformly from the vocabulary: random prompts share no prefix,
    so prefix caching cannot flatter a number."""
    if isinstance(lengths, int):
        lengths = [lengths] * n
    return [[rng.randrange(vocab_size) for _ in range(length)] for length in lengths]


def sampled_lengths(n: int, mean: int, range_ratio: float, rng: random.Random) -> list[int]:
    """vLLM's random-dataset lengths: uniform in [mean*(1-r), mean*(1+r)], at least 1."""
    if range_ratio <= 0:
        return [mean] * n
    lo = max(1, int(mean * (1 - range_ratio)))
    hi = max(lo, int(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def timed(device: torch.device) -> Iterator[list[float]]:
    """`with timed(dev) as t: ...` leaves the elapsed seconds in t[0], the device drained on
    both ends so that queued kernels are neither missed nor charged to the next phase."""
    out: list[float] = []
    synchronize(device)
    t0 = time.perf_counter()
    yield out
    synchronize(device)
    out.append(time.perf_counter() - t0)
