"""Tiny integer weight-only checkpoints for the tests (issue 29): the tiny Llama of fp8_models
written in a GPTQ / AWQ / compressed-tensors packing (models/quant_formats.py), and an
independent dequantization of those tensors, element by element from the formats'
descriptions, for the twin checkpoints and the loader's checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from compile_engine.models.quant import PackedFormat
from compile_engine.models.quant_formats import (
    packed_quantization_config,
    quantize_checkpoint_linear,
)


def _fields(word: int, bits: int) -> list[int]:
    """An int32 word's fields, lowest bits first (the formats' packing, element by element)."""
    u = word & 0xFFFFFFFF
    return [(u >> (bits * i)) & ((1 << bits) - 1) for i in range(32 // bits)]


def independent_dequantize(parts: dict[str, torch.Tensor], fmt: PackedFormat) -> np.ndarray:
    """w [N, K] float32 straight from a format's tensors, each element by its definition:
    GPTQ w[n, k] = s[g, n] (q[k, n] - z[g, n]), g = g_idx[k], v1 zeros stored minus one;
    AWQ the same with the word's nibble i holding column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i];
    compressed-tensors w = (q - z) s of values stored + 2^(bits - 1), g = g_idx[k] or k // g."""
    bits, pf = fmt.bits, 32 // fmt.bits
    mid = 1 << (bits - 1)
    if fmt.kind == "pack-quantized":
        n, k = parts["weight_shape"].tolist()
        packed = parts["weight_packed"].numpy()
        q = np.array([[f for word in row for f in _fields(int(word), bits)] for row in packed])
        scale = parts["weight_scale"].float().numpy()  # [N, G]
        if fmt.symmetric:
            z = np.full(scale.shape, mid)
        else:
            zp = parts["weight_zero_point"].numpy()  # [N / pf, G], packed along N
            z = np.zeros(scale.shape, dtype=np.int64)
            for r in range(zp.shape[0]):
                for g in range(zp.shape[1]):
                    for i, f in enumerate(_fields(int(zp[r, g]), bits)):
                        if r * pf + i < n:
                            z[r * pf + i, g] = f
        group = k // scale.shape[1]
        g_idx = parts["weight_g_idx"].numpy() if "weight_g_idx" in parts else np.arange(k) // group
        w = np.zeros((n, k), dtype=np.float32)
        for c in range(k):
            g = g_idx[c]
            w[:, c] = (q[:, c] - z[:, g]).astype(np.float32) * scale[:, g]
        return w
    qweight, qzeros = parts["qweight"].numpy(), parts["qzeros"].numpy()
    scale = parts["scales"].float().numpy()  # [G, N]
    if fmt.kind == "awq":
        order = [0, 2, 4, 6, 1, 3, 5, 7]
        k, n = qweight.shape[0], qweight.shape[1] * 8
        q = np.zeros((k, n), dtype=np.int64)
        for c in range(qweight.shape[1]):
            for r in range(k):
                for i, f in enumerate(_fields(int(qweight[r, c]), 4)):
                    q[r, 8 * c + order[i]] = f
        z = np.zeros(scale.shape, dtype=np.int64)
        for c in range(qzeros.shape[1]):
            for g in range(qzeros.shape[0]):
                for i, f in enumerate(_fields(int(qzeros[g, c]), 4)):
                    z[g, 8 * c + order[i]] = f
        g_idx = np.arange(k) // (k // scale.shape[0])
    else:
        k, n = qweight.shape[0] * pf, qweight.shape[1]
        q = np.zeros((k, n), dtype=np.int64)
        for r in range(qweight.shape[0]):
            for c in range(n):
                for i, f in enumerate(_fields(int(qweight[r, c]), bits)):
                    q[r * pf + i, c] = f
        z = np.zeros(scale.shape, dtype=np.int64)
        for g in range(qzeros.shape[0]):
            for c in range(qzeros.shape[1]):
                for i, f in enumerate(_fields(int(qzeros[g, c]), bits)):
                    z[g, c * pf + i] = f + (1 if fmt.kind == "gptq" else 0)
        g_idx = parts["g_idx"].numpy()
    w = np.zeros((n, k), dtype=np.float32)
    for r in range(k):
        g = g_idx[r]
        w[:, r] = scale[g] * (q[r] - z[g]).astype(np.float32)
    return w


def write_packed(source: Path, out: Path, fmt: PackedFormat, act_order_seed: int = 0) -> Path:
    """The tiny Llama's checkpoint in `fmt` (act-order: one permutation per layer input, shared
    by the projections that read it, as GPTQ's Hessian order is)."""
    tensors = load_file(str(source / "model.safetensors"))
    gen = torch.Generator().manual_seed(act_order_seed)
    perms: dict[tuple[str, int], torch.Tensor] = {}
    written = {}
    for name, tensor in tensors.items():
        perm = None
        if fmt.act_order:
            reader = "o" if "o_proj" in name else "down" if "down_proj" in name else (
                "attn" if "self_attn" in name else "mlp")  # fmt: skip
            key = (name.split(".layers.")[-1].split(".")[0] + reader, tensor.shape[-1])
            perm = perms.setdefault(key, torch.randperm(tensor.shape[-1], generator=gen))
        written.update(quantize_checkpoint_linear(name, tensor, fmt, perm))
    out.mkdir(parents=True)
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = packed_quantization_config(fmt)
    (out / "config.json").write_text(json.dumps(config))
    return out


def write_twin(packed: Path, source: Path, out: Path, fmt: PackedFormat) -> Path:
    """The packed checkpoint dequantized independently, as a float32 checkpoint."""
    tensors = load_file(str(packed / "model.safetensors"))
    twin = dict(load_file(str(source / "model.safetensors")))
    prefixes = {n.rpartition(".")[0] for n in tensors if n.endswith(("qweight", "weight_packed"))}
    for prefix in prefixes:
        parts = {n.rpartition(".")[2]: t for n, t in tensors.items() if n.startswith(prefix + ".")}
        twin[f"{prefix}.weight"] = torch.from_numpy(independent_dequantize(parts, fmt))
    out.mkdir(parents=True)
    save_file(twin, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((source / "config.json").read_text())
    return out
