"""The activation reserve of the KV pool, measured once per artifact and device.

Sizing the KV pool needs the peak memory of the largest step: `profile_activation_bytes` runs
an eager forward of `max_num_batched_tokens` tokens with the reference attention (2.6 s of an
8B model's start-up on the H200). The peak is a function of the model's code and shapes, the
dtype, the step size, the device and torch, so a start from an artifact keeps it in the
artifact's compile cache under a key of all of them, and the next start with the same key
reads it instead of measuring. A cold start, a changed key, or an unreadable entry measures.
`compile-engine build` measures it already, for the step sizes of `serve` and `LLM` with the
build's settings (`build_step`): the build runs on a machine of the target, so a first start
finds it too (1.7 s of the H200's first start at 3fb7708).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from compile_engine.compiler.artifact import code_hash, device_description
from compile_engine.compiler.build import CACHE_SUBDIR as ARTIFACT_CACHE_SUBDIR
from compile_engine.compiler.build import BuildStep
from compile_engine.models.loader import LoadedModel
from compile_engine.runtime.model_runner import profile_activation_bytes

log = logging.getLogger(__name__)

CACHE_SUBDIR = "activation-profile"  # under the artifact's compile cache
# The files whose code decides the peak besides the model's (which the artifact's code hash
# covers): the profile itself and the sampler it stands in for.
_RUNTIME_FILES = ("model_runner.py", "sampler.py")


def profile_key(
    loaded: LoadedModel, num_tokens: int, num_rows: int, device_name: str, code: str
) -> str:
    """Everything the measured peak depends on; `code` identifies the model code."""
    config = {
        k: str(v) if isinstance(v, torch.dtype) else v
        for k, v in dataclasses.asdict(loaded.config).items()
    }
    here = Path(__file__).resolve().parent
    runtime_code = hashlib.sha256(b"".join((here / f).read_bytes() for f in _RUNTIME_FILES))
    parts = {
        "config": config,
        "dtype": str(loaded.dtype),
        "num_tokens": num_tokens,
        "num_rows": num_rows,
        "device": device_name,
        "torch": torch.__version__,
        "code": code,
        "runtime_code": runtime_code.hexdigest(),
    }
    blob = json.dumps(parts, sort_keys=True, default=repr).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def activation_bytes(
    loaded: LoadedModel,
    num_tokens: int,
    num_rows: int,
    *,
    cache_dir: Path | None,
    device_name: str,
    code: str,
    profile: Callable[[LoadedModel, int, int], int] = profile_activation_bytes,
) -> tuple[int, bool]:
    """(peak activation bytes, whether it came from the cache). Without `cache_dir` (a start
    from a checkpoint, not an artifact) it always measures."""
    if cache_dir is None:
        return profile(loaded, num_tokens, num_rows), False
    entry = _entry(loaded, num_tokens, num_rows, cache_dir, device_name, code)
    cached = _read(entry)
    if cached is not None:
        return cached, True
    peak = profile(loaded, num_tokens, num_rows)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        # Written whole then renamed, so a concurrent start never reads half a file.
        tmp = entry.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"peak_bytes": peak, "num_tokens": num_tokens}))
        tmp.replace(entry)
    except OSError as exc:  # a read-only artifact: measure again next time
        log.warning("could not cache the activation profile in %s: %s", entry.parent, exc)
    return peak, False


def lookup(
    loaded: LoadedModel,
    num_tokens: int,
    num_rows: int,
    *,
    cache_dir: Path | None,
    device_name: str,
    code: str,
) -> int | None:
    """The cached peak, or None when it must be measured (no cache, no entry, a bad entry)."""
    if cache_dir is None:
        return None
    return _read(_entry(loaded, num_tokens, num_rows, cache_dir, device_name, code))


def _entry(
    loaded: LoadedModel,
    num_tokens: int,
    num_rows: int,
    cache_dir: Path,
    device_name: str,
    code: str,
) -> Path:
    key = profile_key(loaded, num_tokens, num_rows, device_name, code)
    return Path(cache_dir) / CACHE_SUBDIR / f"{key}.json"


def _read(entry: Path) -> int | None:
    """The peak an entry holds, or None (no entry, a bad entry)."""
    try:
        peak = json.loads(entry.read_text())["peak_bytes"]
        if isinstance(peak, int) and peak >= 0:
            return peak
        log.warning("ignoring the invalid activation profile %s; measuring", entry)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring the unreadable activation profile %s (%s); measuring", entry, exc)
    return None


def build_step(
    sizes: list[tuple[int, int]],
    profile: Callable[[LoadedModel, int, int], int] = profile_activation_bytes,
) -> BuildStep:
    """A `compile-engine build` step that stores the peak for each (tokens, rows) step size in
    the artifact, keyed as a start from it will look it up. Only CUDA builds: the engine sizes
    the pool from a profile only on CUDA."""

    def step(loaded: LoadedModel, artifact: Path) -> None:
        if not _profiled_at_start(loaded):
            return
        for num_tokens, num_rows in dict.fromkeys(sizes):
            activation_bytes(
                loaded,
                num_tokens,
                num_rows,
                cache_dir=Path(artifact) / ARTIFACT_CACHE_SUBDIR,
                device_name=device_description("h100"),
                code=code_hash(),
                profile=profile,
            )

    return step


def _profiled_at_start(loaded: LoadedModel) -> bool:
    """Whether a start of this model sizes its KV pool from a profile: on CUDA only."""
    return next(loaded.model.parameters()).device.type == "cuda"
