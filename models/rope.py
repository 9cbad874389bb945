"""Rotary position embedding frequencies for the HF rope types our models use.

Each function returns (inv_freq [rot_dim / 2] float32, attention_scaling). The cos/sin table the
`rotary` op reads is built once from them: positions are integers below max_model_len, so a
table lookup replaces HF's per-step matmul and gives the same float32 values.
"""

from __future__ import annotations

import math

import torch

from compile_engine.models.errors import UnsupportedModelError


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (theta**exponents)


def _default(params: dict, dim: int) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(params["rope_theta"], dim), 1.0


def _linear(params: dict, dim: int) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(params["rope_theta"], dim) / params["factor"], 1.0


def _llama3(params: dict, dim: int) -> tuple[torch.Tensor, float]:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, and the band in
    # between blends the two linearly in 1 / wavelength.
    inv_freq = _base_inv_freq(params["rope_theta"], dim)
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled), 1.0


def _yarn(params: dict, dim: int) -> tuple[torch.Tensor, float]:
    theta, factor = params["rope_theta"], params["factor"]
    old_len = params["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


ROPE_TYPES = {"default": _default, "linear": _linear, "llama3": _llama3, "yarn": _yarn}


def rope_inv_freq(params: dict, rot_dim: int) -> tuple[torch.Tensor, float]:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    return ROPE_TYPES[rope_type](params, rot_dim)


def cos_sin_table(params: dict, rot_dim: int, max_positions: int) -> torch.Tensor:
    """[max_positions, rot_dim] float32: cos of each frequency, then sin (HF's neox layout)."""
    inv_freq, scaling = rope_inv_freq(params, rot_dim)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)
