"""Tiny random draft heads for the tiny targets: an EAGLE-3 head in the published layout
(config.json + safetensors, as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B) and the DeepSeek-V3 MTP
layer appended to a tiny DeepSeek-V3 checkpoint (tests/tiny_deepseek.py). `constant` heads
(and `constant_target`) score every token 0 (a zero final norm), so that a head agrees with
such a target on every draft and the accept path runs."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from compile_engine.benchmarks.make_model import eagle3_config, eagle3_tensors


def make_tiny_eagle3(
    target: Path,
    directory: Path,
    *,
    seed: int = 0,
    draft_vocab_size: int = 64,
    constant: bool = False,
    aux_layer_ids: list[int] | None = None,
) -> Path:
    """An EAGLE-3 head for the HF model in `target`, random (std 0.15: far from uniform)."""
    raw = json.loads((Path(target) / "config.json").read_text())
    config = eagle3_config(raw, draft_vocab_size, aux_layer_ids)
    gen = torch.Generator().manual_seed(seed)
    tensors = eagle3_tensors(config, torch.float32, "cpu", gen, std=0.15, constant=constant)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def make_constant_target(make, name: str, directory: Path):
    """`make(name, directory)`'s model with its final norm zeroed: every logit 0, so greedy
    decoding emits token 0 forever."""
    model = make(name, directory)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    model.save_pretrained(directory)
    return model
