"""Tiny FP8 checkpoints for the tests: a tiny Llama at HF's init scale, written in each FP8
layout of models/quant.py (block scales 16 x 16, so that its projections hold several
blocks), with its dequantized float32 twin (the same weights, as a plain checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from compile_engine.models.quant import (
    QuantScheme,
    checkpoint_quantization_config,
    dequantize_fp8_ref,
    quant_config,
    quantize_checkpoint_tensor,
)

BLOCK = (16, 16)


def make_tiny_llama(directory: Path, dtype: torch.dtype = torch.float32) -> Path:
    """The tiny Llama at HF's own init scale (0.02): tests/tiny_models' 0.15, chosen to make
    wrong attention obvious, leaves 64-wide dot products so few and large that FP8's 3 mantissa
    bits move the logits' direction by ~1% (cosine 0.990-0.995 over the layouts); at 0.02,
    with the same weights' rounding, 0.9994-0.9996 and every argmax equal."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.02,
        architectures=["LlamaForCausalLM"],
        eos_token_id=2,
        bos_token_id=1,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(dtype).save_pretrained(directory)
    return Path(directory)


def scheme_of(layout: str) -> QuantScheme:
    section = checkpoint_quantization_config(layout, BLOCK)
    return quant_config({"quantization_config": section}, None).scheme


def write_fp8(source: Path, out: Path, layout: str) -> tuple[Path, Path]:
    """The FP8 checkpoint of `source` in `layout` (out/fp8), and its dequantized twin
    (out/twin, in source's dtype)."""
    tensors = load_file(str(source / "model.safetensors"))
    quantized, twin = {}, {}
    scheme = scheme_of(layout)
    for name, tensor in tensors.items():
        parts = quantize_checkpoint_tensor(name, tensor, layout, BLOCK)
        quantized.update(parts)
        if len(parts) == 1:
            twin[name] = tensor
            continue
        scale = next(v for k, v in parts.items() if "weight_scale" in k)
        as_stored = QuantScheme(scheme.weight_scale, "none", scheme.block)
        twin[name] = dequantize_fp8_ref(parts[name], scale, str(as_stored), tensor.dtype)
    config = json.loads((source / "config.json").read_text())
    for directory, weights, quant in ((out / "fp8", quantized, True), (out / "twin", twin, False)):
        directory.mkdir(parents=True)
        save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
        written = dict(config)
        if quant:
            written["quantization_config"] = checkpoint_quantization_config(layout, BLOCK)
        (directory / "config.json").write_text(json.dumps(written))
    return out / "fp8", out / "twin"
