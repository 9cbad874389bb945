"""Quantized linear layers: the `quant_linear` op, its quantize / dequantize ops, the scheme they
take, the module that swaps in for a Linear, and what a checkpoint's quantization_config means.

FP8 (e4m3, max 448) weights with one of three weight-scale kinds, by the checkpoint formats
production serves on Hopper (compressed-tensors from llm-compressor, DeepSeek-V3 / Qwen "fp8"):

- tensor: one float32 scale for the whole weight, `w ~= q * s`;
- channel: one scale per output row, [N];
- block: one scale per (block_n x block_k) tile, [cdiv(N, block_n), cdiv(K, block_k)]
  (DeepSeek-V3's 128 x 128, checkpoint name `weight_scale_inv`, a multiplier despite the name).

and activations either quantized dynamically per token (a scale per row, amax / 448), quantized
statically per tensor (the checkpoint's `input_scale`), or left in the model dtype (W8A16). The
reference (`quant_linear_ref`) is literally that: dequantize the weight, quantize-dequantize the
activation as the scheme says, matmul in float32, round to the activation dtype. It runs on any
device (torch 2.13's CPU has float8_e4m3fn tensors) and is every lowering's oracle.

Integer weight-only schemes (issue 29) use the same op and schema, activation "none", one scale
per group of `group` (32/64/128) consecutive input columns of a row:

- int8: q int8, w = s * q; scale [N, G] float32 (GGUF Q8_0);
- uint8: q 0..255, w = s * q + m; scale [N, G, 2] = (s, m) float32;
- int4: q 0..15, w = s * (q - 8); scale [N, G] float32 (GGUF Q4_0, symmetric GPTQ);
- uint4: q 0..15, w = s * q + m; scale [N, G, 2] = (s, m) float32 (GGUF Q4_1);
- uint4_zp / uint8_zp: q 0..15 / 0..255 with an integer zero point per group, w = (q - z) * s;
  scale [N, G, 2] = (s, z) float32, z a whole number (GPTQ, AWQ and compressed-tensors
  asymmetric checkpoints: their own formula, so the product is the only rounding; folding z
  into an offset m = -z * s would round twice).

Each rounds as gguf's dequantize does (one product, then the add), so the reference's weight is
the file's fp32 weight bit for bit. Layouts: "plain" (4-bit: two codes a byte, even k in the low
nibble) and "int4pack_cpu", ATen's CPU int4 GEMM layout (`_weight_int4pack_mm_for_cpu`): rows
in blocks of B = 64 (32 where ATen runs AVX2), byte [b, k, j] = q[Bb + j, k] | q[Bb + B/2 + j,
k] << 4 viewed as [N, K / 2], with (scale, zero) [G, N, 2] in the model dtype and w = (q - 8) *
scale + zero, i.e. zero = m + 8 s rounded to that dtype: that rounding is the layout's only
change to the weights.
Checkpoints hand QuantLinear unpacked codes ([n, K], one a byte) and float32 scales; it packs.

Quantization arrives by composition (STYLE 13): the model is built as usual on the meta
device, `quantize_model` swaps each decoder Linear / FusedLinear for a `QuantLinear` of the
same shape (lm_head stays in the model dtype: it runs outside the compiled graph, and vLLM
keeps it unquantized too), and the loader fills the new parameters by their checkpoint names.
"""

from __future__ import annotations

import fnmatch
import functools
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.library import custom_op

from compile_engine.models.errors import CheckpointError, UnsupportedModelError
from compile_engine.models.layers import FusedLinear, Linear

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# The smallest per-token scale: an all-zero row quantizes to zeros, not NaN.
MIN_SCALE = 1e-12

WEIGHT_SCALES = ("tensor", "channel", "block", "group")
# int16_group: 16 bits, dynamic, one scale (amax / 32512) per row and group of the weight's
# group columns: what the vnni_cpu layout's integer dot products take (csrc/vnni_linear.cpp).
# int8 there (llama.cpp's Q8 activations) agreed 96.8% top-1 with SmolLM2's file in float32.
ACTIVATIONS = ("none", "token", "tensor", "int16_group")
INT_WEIGHTS = ("int8", "uint8", "int4", "uint4", "uint4_zp", "uint8_zp")  # weight-only, per group
INT_BITS = {"int8": 8, "uint8": 8, "int4": 4, "uint4": 4, "uint4_zp": 4, "uint8_zp": 8}
WEIGHTS = ("fp8_e4m3", *INT_WEIGHTS)
GROUP_SIZES = (16, 32, 64, 128)  # 16: GGUF Q6_K's sub-blocks
LAYOUTS = ("plain", "int4pack_cpu", "vnni_cpu")
# What ATen's CPU int4 GEMM computes in (its input, scales and output): its fast path; float16
# and float32 inputs take scalar loops 30-60x slower (kernels_generated/int_linear_cpu.py). A
# float32 model casts around it (issue 29: the residual stream in float32).
INT4PACK_DTYPE = torch.bfloat16
# ATen's CPU int4 layout packs rows in blocks of 64 where its kernels run AVX-512, of 32 under
# AVX2 (int4pack_block_n probes which).
INT4PACK_BLOCK_CANDIDATES = (64, 32)
# The vnni_cpu layout (kernels_generated/csrc/vnni_linear.cpp): rows in blocks of 16 (one
# int32 lane each), groups of 32 columns, activations quantized per group too.
VNNI_BLOCK_N = 16
VNNI_GROUP = 32
VNNI_WEIGHTS = ("int4", "uint4", "int8")
# What a vnni_cpu code is offset by from the scheme's own (int8's signed codes stored unsigned).
VNNI_CODE_OFFSET = {"int4": 0, "uint4": 0, "int8": 128}


class QuantizationError(UnsupportedModelError):
    """A quantization setting or a checkpoint's quantization_config is not one this engine
    runs; the message names the field and what is supported."""


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """What one quantized linear computes. weight: the stored format ("fp8_e4m3", or an integer
    one of INT_WEIGHTS). weight_scale: "tensor", "channel" or "block" (block: (block_n, block_k)
    in `block`) for FP8; "group" (`group` columns a scale) for the integer formats. activation:
    "none" (kept in the model dtype: W8A16, and every integer format), "token" (dynamic, one
    scale a row) or "tensor" (static, the checkpoint's input_scale). layout: how an integer
    weight is stored (LAYOUTS). Its string form (`str`, `parse`) is what the op carries."""

    weight_scale: str
    activation: str
    block: tuple[int, int] | None = None
    weight: str = "fp8_e4m3"
    group: int | None = None
    layout: str = "plain"

    def __post_init__(self) -> None:
        if self.weight not in WEIGHTS:
            raise QuantizationError(f"weight format {self.weight!r}: one of {', '.join(WEIGHTS)}")
        if self.weight_scale not in WEIGHT_SCALES:
            raise QuantizationError(
                f"weight scale {self.weight_scale!r}: one of {', '.join(WEIGHT_SCALES)}"
            )
        if self.activation not in ACTIVATIONS:
            raise QuantizationError(
                f"activation {self.activation!r}: one of {', '.join(ACTIVATIONS)}"
            )
        if self.layout not in LAYOUTS:
            raise QuantizationError(f"layout {self.layout!r}: one of {', '.join(LAYOUTS)}")
        if self.weight in INT_WEIGHTS:
            if self.weight_scale != "group" or self.group not in GROUP_SIZES:
                raise QuantizationError(
                    f"{self.weight} weights take per-group scales of "
                    f"{'/'.join(map(str, GROUP_SIZES))} columns, not {self.weight_scale} "
                    f"(group {self.group})"
                )
            if self.layout == "vnni_cpu":
                if self.weight not in VNNI_WEIGHTS or self.group != VNNI_GROUP:
                    raise QuantizationError(
                        f"the vnni_cpu layout holds {', '.join(VNNI_WEIGHTS)} weights in groups "
                        f"of {VNNI_GROUP}, not {self.weight} group {self.group}"
                    )
                if self.activation != "int16_group":
                    raise QuantizationError(
                        "the vnni_cpu layout quantizes activations: int16_group"
                    )
                return
            if self.activation != "none":
                raise QuantizationError(f"{self.weight} weights are weight-only (activation none)")
            if self.layout == "int4pack_cpu" and self.weight not in ("int4", "uint4"):
                raise QuantizationError("the int4pack_cpu layout holds int4 / uint4 weights only")
            return
        if self.weight_scale == "group" or self.group is not None or self.layout != "plain":
            raise QuantizationError("FP8 weights take tensor, channel or block scales, plain")
        if (self.weight_scale == "block") != (self.block is not None):
            raise QuantizationError("a block size goes with block weight scales, and only there")
        if self.block is not None and (
            len(self.block) != 2 or any(not isinstance(b, int) or b < 1 for b in self.block)
        ):
            raise QuantizationError(f"block size {self.block!r}: want two whole numbers >= 1")

    @property
    def is_int(self) -> bool:
        return self.weight in INT_WEIGHTS

    @property
    def bits(self) -> int:
        return INT_BITS.get(self.weight, 8)

    @property
    def has_min(self) -> bool:
        """An offset per group (uint formats: w = s * q + m), stored beside the scale."""
        return self.weight in ("uint8", "uint4")

    @property
    def has_zero(self) -> bool:
        """An integer zero point per group (the _zp formats: w = (q - z) * s), stored beside
        the scale."""
        return self.weight.endswith("_zp")

    @property
    def scale_pairs(self) -> bool:
        """The group scale is [N, G, 2]: (s, m) or (s, z)."""
        return self.has_min or self.has_zero

    def __str__(self) -> str:
        scale = self.weight_scale
        if self.block is not None:
            scale = f"block{self.block[0]}x{self.block[1]}"
        elif self.group is not None:
            scale = f"group{self.group}"
        text = f"{self.weight}:{scale}:{self.activation}"
        return text if self.layout == "plain" else f"{text}:{self.layout}"

    @classmethod
    def parse(cls, text: str) -> QuantScheme:
        parts = text.split(":")
        if len(parts) not in (3, 4):
            raise QuantizationError(f"quant scheme {text!r}: want weight:scale:activation[:layout]")
        weight, scale, activation = parts[:3]
        layout = parts[3] if len(parts) == 4 else "plain"
        block = group = None
        if match := re.fullmatch(r"block(\d+)x(\d+)", scale):
            scale, block = "block", (int(match[1]), int(match[2]))
        elif match := re.fullmatch(r"group(\d+)", scale):
            scale, group = "group", int(match[1])
        return cls(scale, activation, block, weight, group, layout)

    def weight_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        if self.is_int and self.bits == 4:
            return (out_features, in_features // 2)
        return (out_features, in_features)

    @property
    def weight_dtype(self) -> torch.dtype:
        if self.layout == "vnni_cpu":
            return torch.uint8  # int8 codes stored offset by 128
        return {"fp8_e4m3": FP8_DTYPE, "int8": torch.int8}.get(self.weight, torch.uint8)

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, ...]:
        if self.weight_scale == "tensor":
            return ()
        if self.weight_scale == "channel":
            return (out_features,)
        if self.weight_scale == "group":
            groups = in_features // self.group
            if self.layout == "int4pack_cpu":
                return (groups, out_features, 2)
            if self.layout == "vnni_cpu":
                return (out_features // VNNI_BLOCK_N, groups, 2, VNNI_BLOCK_N)
            return (out_features, groups, 2) if self.scale_pairs else (out_features, groups)
        bn, bk = self.block
        return (-(-out_features // bn), -(-in_features // bk))

    def check_shape(self, out_features: int, in_features: int) -> None:
        """An integer weight's shape must divide into its groups (and its layout's blocks)."""
        if not self.is_int:
            return
        if in_features % self.group:
            raise QuantizationError(
                f"{in_features} input features do not divide into groups of {self.group}"
            )
        block = layout_block_rows(self.layout)
        if block is not None and out_features % block:
            raise QuantizationError(
                f"{out_features} output features: the {self.layout} layout packs rows in blocks "
                f"of {block}; use --dtype float32 for this model"
            )


# --------------------------------------------------------------------------- references


def quantize_fp8_ref(x: Tensor, scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [..., K] -> (q [..., K] float8_e4m3fn, scale float32) with x ~= q * scale. scale None:
    dynamic, one scale a row ([..., 1], the row's amax / 448); given (static, per tensor): the
    values divided by it, saturated at +-448, and the scale returned as given."""
    xf = x.float()
    if scale is None:
        scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(MIN_SCALE) / FP8_MAX
    else:
        scale = scale.float()
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def expand_scale(scale: Tensor, shape: tuple[int, int], scheme: QuantScheme) -> Tensor:
    """The weight scale broadcastable to a [N, K] weight, float32."""
    scale = scale.float()
    if scheme.weight_scale == "tensor":
        return scale.reshape(())
    if scheme.weight_scale == "channel":
        return scale.reshape(-1, 1)
    bn, bk = scheme.block
    n, k = shape
    return scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def dequantize_fp8_ref(q: Tensor, scale: Tensor, scheme: str, dtype: torch.dtype) -> Tensor:
    """A quantized weight q [N, K] with its scale (the scheme's kind) -> q * scale in `dtype`."""
    parsed = QuantScheme.parse(scheme)
    return (q.float() * expand_scale(scale, tuple(q.shape), parsed)).to(dtype)


def _pack_int4pack(codes: Tensor, block: int) -> Tensor:
    n, k = codes.shape
    rows = codes.reshape(n // block, 2, block // 2, k)  # [N / B, 2, B / 2, K]
    low, high = rows[:, 0].transpose(1, 2), rows[:, 1].transpose(1, 2)  # [N / B, K, B / 2]
    return (low | (high << 4)).reshape(n, k // 2)


@functools.cache
def int4pack_block_n() -> int:
    """Rows a block of ATen's CPU int4 layout holds on this machine: compiled into ATen per CPU
    capability (64 under AVX-512, 32 under AVX2) and not exposed, so found by packing a probe
    with ATen's own op and comparing it with each candidate's packing."""
    g = torch.Generator().manual_seed(0)
    probe = torch.randint(0, 16, (128, 64), dtype=torch.uint8, generator=g)
    aten = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe.to(torch.int32), 1)
    for block in INT4PACK_BLOCK_CANDIDATES:
        if torch.equal(aten, _pack_int4pack(probe, block)):
            return block
    raise QuantizationError(
        "ATen's CPU int4 layout on this machine is none this engine knows (rows in blocks of "
        f"{INT4PACK_BLOCK_CANDIDATES}); use --dtype float32"
    )


def layout_block_rows(layout: str) -> int | None:
    """Output rows a block of the layout packs together (None: any number)."""
    if layout == "int4pack_cpu":
        return int4pack_block_n()
    return VNNI_BLOCK_N if layout == "vnni_cpu" else None


def pack_int4(codes: Tensor, layout: str) -> Tensor:
    """4-bit codes [N, K] (uint8, 0..15) -> the layout's bytes [N, K / 2]."""
    codes = codes.to(torch.uint8)
    if layout == "plain":
        return codes[:, 0::2] | (codes[:, 1::2] << 4)
    return _pack_int4pack(codes, int4pack_block_n())


def unpack_int4(weight: Tensor, layout: str) -> Tensor:
    """The layout's bytes [N, K / 2] -> 4-bit codes [N, K] (uint8, 0..15)."""
    n, half = weight.shape
    low, high = weight & 15, weight >> 4
    if layout == "plain":
        return torch.stack([low, high], dim=-1).reshape(n, 2 * half)  # [N, K / 2, 2]
    block = int4pack_block_n()
    low = low.reshape(n // block, 2 * half, block // 2).transpose(1, 2)  # [N / B, B / 2, K]
    high = high.reshape(n // block, 2 * half, block // 2).transpose(1, 2)
    return torch.cat([low, high], dim=1).reshape(n, 2 * half)


# What each build of the vnni_cpu layout's kernel needs of the CPU (/proc/cpuinfo's flags), the
# fastest first: AVX-512 VNNI (Intel since Cascade Lake, AMD since Zen 4), else AVX2 with FMA.
VNNI_CPU_ISAS = {
    "avx512_vnni": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}),
    "avx2": frozenset({"avx2", "fma"}),
}


@functools.cache  # the CPU's flags and the compiler do not change while a process runs
def vnni_cpu_isas() -> tuple[str, ...]:
    """The builds of the vnni_cpu layout's kernel this machine runs, fastest first: x86 on Linux
    with a C++ compiler to build them with (kernels_generated/vnni_linear_cpu.py builds each
    once into the cache)."""
    if not sys.platform.startswith("linux") or shutil.which("g++") is None:
        return ()
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    flags = set(next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines()
                      if line.startswith("flags")), []))  # fmt: skip
    return tuple(isa for isa, needs in VNNI_CPU_ISAS.items() if needs <= flags)


def vnni_cpu_supported() -> bool:
    """Whether this machine runs the vnni_cpu layout's kernel (one of its builds)."""
    return bool(vnni_cpu_isas())


def pack_vnni(codes: Tensor, bits: int) -> Tensor:
    """Codes [N, K] (uint8: 4-bit 0..15, or 8-bit offset to 0..255) -> the vnni_cpu layout's
    bytes, [N, K / 2] or [N, K]: per block of 16 rows and group of 32 columns, 64-byte vectors
    whose lane j holds row j's codes k..k+3 (8-bit; k = 4p), or k..k+3 in the low nibbles and
    k+4..k+7 in the high ones (4-bit; k = 8p)."""
    codes = codes.to(torch.uint8)
    n, k = codes.shape
    blocks, groups = n // VNNI_BLOCK_N, k // VNNI_GROUP
    if bits == 8:
        lanes = codes.view(blocks, VNNI_BLOCK_N, groups, 8, 4).permute(0, 2, 3, 1, 4)
        return lanes.reshape(n, k)
    lanes = codes.view(blocks, VNNI_BLOCK_N, groups, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    return (lanes[..., 0] | (lanes[..., 1] << 4)).reshape(n, k // 2)


def unpack_vnni(weight: Tensor, bits: int) -> Tensor:
    """pack_vnni's inverse: the layout's bytes -> codes [N, K] (uint8)."""
    n = weight.shape[0]
    k = weight.shape[1] * (8 // bits)
    blocks, groups = n // VNNI_BLOCK_N, k // VNNI_GROUP
    if bits == 8:
        lanes = weight.reshape(blocks, groups, 8, VNNI_BLOCK_N, 4).permute(0, 3, 1, 2, 4)
        return lanes.reshape(n, k)
    packed = weight.reshape(blocks, groups, 4, VNNI_BLOCK_N, 4)
    lanes = torch.stack([packed & 0x0F, packed >> 4], dim=-1)  # [B, G, 4, 16, 4, 2]
    return lanes.permute(0, 3, 1, 2, 5, 4).reshape(n, k)


def vnni_scales(scale: Tensor, scheme: QuantScheme) -> Tensor:
    """Plain-layout scales ([N, G] or [N, G, 2] (s, m), float32) -> vnni_cpu's (s, m)
    [N / 16, G, 2, 16] for w = s * u + m over the stored codes u: m = -8 s for int4, -128 s
    for int8 (its codes stored + 128); both exact."""
    if scheme.has_min:
        s, m = scale[..., 0].float(), scale[..., 1].float()
    else:
        s = scale.float()
        m = -float(8 if scheme.weight == "int4" else 128) * s
    n, groups = s.shape
    pairs = torch.stack([s, m], dim=-1).view(n // VNNI_BLOCK_N, VNNI_BLOCK_N, groups, 2)
    return pairs.permute(0, 2, 3, 1).contiguous()


def unvnni_scales(scale: Tensor) -> Tensor:
    """vnni_cpu's scales [N / 16, G, 2, 16] -> (s, m) [N, G, 2]."""
    blocks, groups = scale.shape[:2]
    return scale.permute(0, 3, 1, 2).reshape(blocks * VNNI_BLOCK_N, groups, 2)


# The int16_group activation's largest code: 127 * 256, so that the kernel's high byte fits.
INT16_GROUP_LEVELS = 32512


def quantize_int16_groups_ref(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """x [..., K] -> (q int16 [..., K], d float32 [..., K / group]): per group
    d = amax / 32512 and q = round(x / d) (half to even), an all-zero group zeros; x ~= q * d."""
    xf = x.float()
    g = xf.reshape(*xf.shape[:-1], xf.shape[-1] // group, group)
    d = g.abs().amax(dim=-1, keepdim=True) / INT16_GROUP_LEVELS
    q = torch.where(d > 0, torch.round(g / torch.where(d > 0, d, 1.0)), 0.0)
    return q.to(torch.int16).reshape(xf.shape), d.squeeze(-1)


def int4pack_scales(scale: Tensor, scheme: QuantScheme, dtype: torch.dtype) -> Tensor:
    """Plain-layout scales ([N, G] or [N, G, 2] (s, m), float32) -> int4pack_cpu's (scale,
    zero) [G, N, 2] in `dtype`, with w = (q - 8) * scale + zero: zero = m + 8 s (0 for int4)."""
    if scheme.has_min:
        s, zero = scale[..., 0].float(), scale[..., 1].float() + 8 * scale[..., 0].float()
    else:
        s = scale.float()
        zero = torch.zeros_like(s)
    return torch.stack([s, zero], dim=-1).transpose(0, 1).to(dtype).contiguous()


def dequantize_int_ref(weight: Tensor, scale: Tensor, scheme: QuantScheme) -> Tensor:
    """An integer weight (the scheme's format and layout) -> float32 [N, K], rounded as gguf's
    dequantize rounds: the product, then the offset."""
    if scheme.layout == "vnni_cpu":
        codes = unpack_vnni(weight, scheme.bits)
        scale = unvnni_scales(scale)
        if not scheme.has_min:  # the scheme's own formula, its one product: the file's weight
            scale = scale[..., 0]
    else:
        codes = unpack_int4(weight, scheme.layout) if scheme.bits == 4 else weight
    n, k = codes.shape
    groups = k // scheme.group
    q = codes.float().reshape(n, groups, scheme.group)  # [N, G, g]
    if scheme.layout == "vnni_cpu" and scheme.weight == "int8":
        q = q - VNNI_CODE_OFFSET["int8"]
    if scheme.layout == "int4pack_cpu":
        s, zero = scale.float().transpose(0, 1).unbind(-1)  # [N, G] each
        return ((q - 8) * s[..., None] + zero[..., None]).reshape(n, k)
    if scheme.has_min:
        s, m = scale.float().unbind(-1)
        return (q * s[..., None] + m[..., None]).reshape(n, k)
    if scheme.has_zero:
        s, z = scale.float().unbind(-1)
        return ((q - z[..., None]) * s[..., None]).reshape(n, k)
    if scheme.weight == "int4":
        q = q - 8
    return (q * scale.float()[..., None]).reshape(n, k)


def quant_linear_ref(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    input_scale: Tensor | None,
    bias: Tensor | None,
    scheme: str,
) -> Tensor:
    """y = act(x) @ dequant(weight)^T (+ bias) in float32, rounded to x's dtype; act is the
    scheme's activation quantize-dequantize (or nothing for W8A16)."""
    parsed = QuantScheme.parse(scheme)
    if parsed.is_int:
        w = dequantize_int_ref(weight, weight_scale, parsed)  # [N, K]
    else:
        w = weight.float() * expand_scale(weight_scale, tuple(weight.shape), parsed)  # [N, K]
    if parsed.layout == "int4pack_cpu":  # the kernel's rounding: its input in bfloat16
        xf = x.to(INT4PACK_DTYPE).float()
    elif parsed.activation == "none":
        xf = x.float()
    elif parsed.activation == "int16_group":
        q, d = quantize_int16_groups_ref(x, parsed.group)
        xf = (q.float().unflatten(-1, (-1, parsed.group)) * d[..., None]).flatten(-2)
    else:
        static = input_scale if parsed.activation == "tensor" else None
        q, scale = quantize_fp8_ref(x, static)
        xf = q.float() * scale
    out = xf @ w.t()  # [..., N]
    if bias is not None:
        out = out + bias.float()
    if parsed.layout == "int4pack_cpu":  # and its output
        out = out.to(INT4PACK_DTYPE)
    return out.to(x.dtype)


# --------------------------------------------------------------------------- ops


@custom_op("ce::quant_linear", mutates_args=())
def quant_linear(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    input_scale: Tensor | None,
    bias: Tensor | None,
    scheme: str,
) -> Tensor:
    """A linear layer over a quantized weight. x [..., K]; weight [N, K] (float8_e4m3fn, int8,
    uint8) or [N, K / 2] (4-bit codes in the scheme's layout); weight_scale per `scheme`
    (QuantScheme.scale_shape: [], [N] or [cdiv(N, bn), cdiv(K, bk)] float32 for FP8, per group
    for the integer formats);
    input_scale [] for static activations, else None; bias [N] or None. Returns [..., N] in
    x's dtype."""
    return quant_linear_ref(x, weight, weight_scale, input_scale, bias, scheme)


@quant_linear.register_fake
def quant_linear_fake(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    input_scale: Tensor | None,
    bias: Tensor | None,
    scheme: str,
) -> Tensor:
    """Shared by every kernel lowering of the op (same schema)."""
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@custom_op("ce::quantize_fp8", mutates_args=())
def quantize_fp8(x: Tensor, scale: Tensor | None) -> tuple[Tensor, Tensor]:
    """x [..., K] -> (q float8_e4m3fn [..., K], scale float32): dynamic per-token scales
    [..., 1] when scale is None, else the static per-tensor scale given."""
    q, out_scale = quantize_fp8_ref(x, scale)
    return q, out_scale.clone() if scale is not None else out_scale


@quantize_fp8.register_fake
def quantize_fp8_fake(x: Tensor, scale: Tensor | None) -> tuple[Tensor, Tensor]:
    q = torch.empty_like(x, dtype=FP8_DTYPE)
    if scale is None:
        return q, x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)
    return q, torch.empty_like(scale, dtype=torch.float32)


@custom_op("ce::dequantize_fp8", mutates_args=())
def dequantize_fp8(q: Tensor, scale: Tensor, scheme: str, dtype: torch.dtype) -> Tensor:
    """A quantized weight [N, K] and its scale (`scheme`'s kind) -> the weight in `dtype`."""
    return dequantize_fp8_ref(q, scale, scheme, dtype)


@dequantize_fp8.register_fake
def dequantize_fp8_fake(q: Tensor, scale: Tensor, scheme: str, dtype: torch.dtype) -> Tensor:
    return torch.empty_like(q, dtype=dtype)


# The ops of this file; models/vocabulary.py gathers them.
QUANT_OPS = {
    "quant_linear": (quant_linear, quant_linear_ref),
    "quantize_fp8": (quantize_fp8, quantize_fp8_ref),
    "dequantize_fp8": (dequantize_fp8, dequantize_fp8_ref),
}


# --------------------------------------------------------------------------- the module


class QuantLinear(nn.Module):
    """A Linear (or FusedLinear, `shards` set) over an FP8 weight: what `quantize_model` swaps
    in. Parameters carry the checkpoint's names: `weight` (float8_e4m3fn [N, K]), the weight
    scale (`weight_scale`, or `weight_scale_inv` for the "fp8" block format), `input_scale`
    (static activations), `bias`.

    online: the checkpoint holds the model-dtype weight and `load_shard` quantizes it row by
    row as it arrives (per-channel scales, so a fused parameter's shards quantize on their
    own); the scale is then a buffer, not a checkpoint tensor. A fused per-tensor weight gets
    one scale from its shards' (the largest), each shard requantized to it in
    `finish_loading`, as vLLM does, so that it keeps the per-tensor GEMM."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        scheme: QuantScheme,
        *,
        bias: bool,
        dtype: torch.dtype,
        shards: dict[str, int] | None = None,
        scale_name: str = "weight_scale",
        online: bool = False,
        act_order: bool = False,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quant_scheme = scheme
        self.scheme = str(scheme)
        self.scale_name, self.online = scale_name, online
        self.shards = dict(shards or {})
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for shard, width in self.shards.items():
            self.offsets[shard] = (start, start + width)
            start += width
        if self.shards and start != out_features:
            raise ValueError(f"shards {self.shards} do not sum to {out_features}")
        if online and (scheme.weight_scale != "channel" or scheme.activation == "tensor"):
            raise QuantizationError(
                f"online quantization makes per-channel weight scales and dynamic activations, "
                f"not {scheme}"
            )
        scheme.check_shape(out_features, in_features)
        if scheme.is_int and online:
            raise QuantizationError(f"{scheme}: integer weights load from a quantized checkpoint")
        self.dtype = dtype
        self.weight = nn.Parameter(
            torch.empty(scheme.weight_shape(out_features, in_features), dtype=scheme.weight_dtype),
            requires_grad=False,
        )
        # int4pack_cpu's scales feed ATen's kernel, which takes them in its input's dtype.
        scale_dtype = INT4PACK_DTYPE if scheme.layout == "int4pack_cpu" else torch.float32
        scale = torch.empty(scheme.scale_shape(out_features, in_features), dtype=scale_dtype)
        if online:
            self.register_buffer(scale_name, scale)
        else:
            self.register_parameter(scale_name, nn.Parameter(scale, requires_grad=False))
        if scheme.activation == "tensor":
            self.input_scale = nn.Parameter(torch.empty((), dtype=torch.float32), False)
        else:
            self.register_parameter("input_scale", None)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        # Act-order (GPTQ desc_act, compressed-tensors actorder "group"): the weight's columns
        # are stored sorted by group (quant_formats), and the activation's gathered to match.
        # A fused parameter's shards share one order (they see the same input, so GPTQ's
        # Hessian order is the same); load_shard checks it.
        if act_order and not scheme.is_int:
            raise QuantizationError("act-order goes with integer weights")
        if act_order:
            self.input_perm = nn.Parameter(torch.empty(in_features, dtype=torch.int64), False)
        else:
            self.register_parameter("input_perm", None)
        self._perm_shards: set[str | None] = set()
        # Per-tensor scales of a fused parameter's shards, until finish_loading: shard -> scale.
        self._shard_scales: dict[str, Tensor] = {}
        self._shard_input_scales: dict[str, Tensor] = {}

    @property
    def scale(self) -> Tensor:
        """The weight scale, whatever its checkpoint name."""
        return getattr(self, self.scale_name)

    def forward(self, x: Tensor) -> Tensor:
        if self.input_perm is not None:
            x = x.index_select(-1, self.input_perm)  # [..., K] in the weight's column order
        return quant_linear(
            x, self.weight, getattr(self, self.scale_name), self.input_scale, self.bias, self.scheme
        )

    def _rows(self, shard: str | None) -> tuple[int, int]:
        return self.offsets[shard] if shard is not None else (0, self.out_features)

    def load_shard(self, param: Tensor, tensor: Tensor, shard: str | None, name: str) -> None:
        start, end = self._rows(shard)
        scheme = self.quant_scheme
        if param is self.input_perm:
            with torch.no_grad():
                self._load_perm(tensor, shard, name)
            return
        if scheme.is_int and param is not self.bias:
            with torch.no_grad():
                self._load_int(param, tensor, name, start, end)
            return
        with torch.no_grad():
            if param is self.weight:
                dst = param[start:end]
                if tuple(tensor.shape) != tuple(dst.shape):
                    raise CheckpointError(
                        f"tensor {name} has shape {tuple(tensor.shape)}, the model expects "
                        f"{tuple(dst.shape)}"
                    )
                if self.online:
                    q, scale = quantize_fp8_ref(tensor.to(dst.device))  # per row
                    dst.copy_(q)
                    self.scale[start:end].copy_(scale.reshape(-1))
                    return
                if tensor.dtype != FP8_DTYPE:
                    raise CheckpointError(
                        f"tensor {name} is {tensor.dtype}; an FP8 checkpoint's weights are "
                        "float8_e4m3fn (for a model-dtype checkpoint use quantization='fp8')"
                    )
                dst.copy_(tensor)
            elif param is self.input_scale:
                if tensor.numel() != 1:
                    raise CheckpointError(f"tensor {name}: a per-tensor input scale, got "
                                          f"shape {tuple(tensor.shape)}")  # fmt: skip
                if shard is None:
                    param.copy_(tensor.reshape(()))
                else:
                    self._shard_input_scales[shard] = tensor.reshape(()).float().clone()
            elif param is self.bias:
                if tuple(tensor.shape) != (end - start,):
                    raise CheckpointError(f"tensor {name} has shape {tuple(tensor.shape)}, the "
                                          f"model expects ({end - start},)")  # fmt: skip
                param[start:end].copy_(tensor)
            elif param is self.scale:
                self._load_scale(param, tensor, shard, name, start, end, scheme)
            else:  # pragma: no cover (the loader only passes this module's parameters)
                raise CheckpointError(f"tensor {name}: no such parameter in {type(self).__name__}")

    def _load_perm(self, tensor: Tensor, shard: str | None, name: str) -> None:
        if tuple(tensor.shape) != (self.in_features,):
            raise CheckpointError(f"tensor {name}: a column order of {self.in_features}, got "
                                  f"shape {tuple(tensor.shape)}")  # fmt: skip
        tensor = tensor.to(self.input_perm.device, torch.int64)
        if self._perm_shards and not torch.equal(self.input_perm, tensor):
            raise CheckpointError(
                f"tensor {name}: act-order shards of one fused layer ({', '.join(self.shards)}) "
                "have different g_idx orders; this engine runs them as one GEMM over one order"
            )
        self.input_perm.copy_(tensor)
        self._perm_shards.add(shard)

    def _load_int(self, param: Tensor, tensor: Tensor, name: str, start: int, end: int) -> None:
        """An integer checkpoint's rows start:end: `weight` as unpacked codes [n, K] (one a
        byte), `weight_scale` as float32 [n, G] or [n, G, 2] (s, m); packed to the layout."""
        scheme = self.quant_scheme
        rows, k = end - start, self.in_features
        block = layout_block_rows(scheme.layout)
        if block is not None and (start % block or rows % block):
            raise CheckpointError(
                f"tensor {name}: rows {start}:{end} do not fall on the {scheme.layout} layout's "
                f"blocks of {block}"
            )
        if param is self.weight:
            if tuple(tensor.shape) != (rows, k):
                raise CheckpointError(f"tensor {name} has shape {tuple(tensor.shape)}, the model "
                                      f"expects {(rows, k)} {scheme.weight} codes")  # fmt: skip
            if scheme.layout == "vnni_cpu":
                offset = VNNI_CODE_OFFSET[scheme.weight]
                codes = (tensor.to(torch.int16) + offset).to(torch.uint8)
                param[start:end].copy_(pack_vnni(codes, scheme.bits))
            elif scheme.bits == 8:
                param[start:end].copy_(tensor.view(scheme.weight_dtype))
            elif scheme.layout == "plain":
                param[start:end].copy_(pack_int4(tensor, "plain"))
            else:
                blocks = param.view(-1, k, block // 2)  # [N / B, K, B / 2] bytes
                b0, b1 = start // block, end // block
                blocks[b0:b1].copy_(pack_int4(tensor, "int4pack_cpu").view(b1 - b0, k, -1))
            return
        want = (rows, k // scheme.group) + ((2,) if scheme.scale_pairs else ())
        if param is not self.scale or tuple(tensor.shape) != want:
            raise CheckpointError(f"tensor {name} has shape {tuple(tensor.shape)}, the model "
                                  f"expects {want} group scales")  # fmt: skip
        if scheme.layout == "int4pack_cpu":
            param[:, start:end].copy_(int4pack_scales(tensor, scheme, param.dtype))
        elif scheme.layout == "vnni_cpu":
            param[start // VNNI_BLOCK_N : end // VNNI_BLOCK_N].copy_(vnni_scales(tensor, scheme))
        else:
            param[start:end].copy_(tensor)

    def _load_scale(
        self,
        param: Tensor,
        tensor: Tensor,
        shard: str | None,
        name: str,
        start: int,
        end: int,
        scheme: QuantScheme,
    ) -> None:
        if scheme.weight_scale == "tensor":
            if tensor.numel() != 1:
                raise CheckpointError(
                    f"tensor {name}: a per-tensor weight scale, got shape {tuple(tensor.shape)}"
                )
            if shard is None:
                param.copy_(tensor.reshape(()))
            else:
                self._shard_scales[shard] = tensor.reshape(()).float().clone()
            return
        if scheme.weight_scale == "channel":
            want = end - start
            if tensor.numel() != want:
                raise CheckpointError(f"tensor {name}: {want} per-channel scales expected, "
                                      f"got shape {tuple(tensor.shape)}")  # fmt: skip
            param[start:end].copy_(tensor.reshape(-1))
            return
        bn, _ = scheme.block
        if start % bn or (end % bn and end != self.out_features):
            raise CheckpointError(
                f"tensor {name}: block scales of {bn} rows cannot split at rows {start}:{end} "
                "of the fused parameter"
            )
        dst = param[start // bn : -(-end // bn)]
        if tuple(tensor.shape) != tuple(dst.shape):
            raise CheckpointError(f"tensor {name} has shape {tuple(tensor.shape)}, the model "
                                  f"expects {tuple(dst.shape)} block scales")  # fmt: skip
        dst.copy_(tensor)

    def finish_loading(self) -> None:
        """After every tensor is read: a fused per-tensor weight takes its shards' largest
        scale, each shard's rows requantized to it; a fused static input scale the largest."""
        with torch.no_grad():
            if self._shard_scales:
                if set(self._shard_scales) != set(self.shards):
                    missing = sorted(set(self.shards) - set(self._shard_scales))
                    raise CheckpointError(f"weight scales missing for shards {missing}")
                top = max(s.item() for s in self._shard_scales.values())
                for shard, scale in self._shard_scales.items():
                    if scale.item() != top:
                        start, end = self.offsets[shard]
                        rows = self.weight[start:end]
                        rows.copy_(
                            (rows.float() * (scale.item() / top))
                            .clamp(-FP8_MAX, FP8_MAX)
                            .to(FP8_DTYPE)
                        )
                self.scale.fill_(top)
                self._shard_scales.clear()
            if self._shard_input_scales:
                self.input_scale.fill_(max(s.item() for s in self._shard_input_scales.values()))
                self._shard_input_scales.clear()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, scheme={self.scheme}"


class QuantEmbedding(nn.Module):
    """A token embedding over an integer weight (a GGUF file's Q8_0 `token_embd`), kept
    quantized in memory: `forward` gathers the rows' codes and dequantizes only those; with tied
    embeddings it is also the lm_head, and `logits` is a quant_linear over the same codes."""

    def __init__(self, vocab_size: int, hidden_size: int, scheme: QuantScheme, dtype: torch.dtype):
        super().__init__()
        if not scheme.is_int or scheme.layout != "plain":
            raise QuantizationError(f"a quantized embedding takes a plain integer scheme: {scheme}")
        scheme.check_shape(vocab_size, hidden_size)
        self.quant_scheme, self.scheme, self.dtype = scheme, str(scheme), dtype
        self.in_features, self.out_features = hidden_size, vocab_size
        shape = scheme.weight_shape(vocab_size, hidden_size)
        self.weight = nn.Parameter(torch.empty(shape, dtype=scheme.weight_dtype), False)
        self.weight_scale = nn.Parameter(
            torch.empty(scheme.scale_shape(vocab_size, hidden_size), dtype=torch.float32), False
        )

    def forward(self, input_ids: Tensor) -> Tensor:
        rows = dequantize_int_ref(self.weight[input_ids], self.weight_scale[input_ids],
                                  self.quant_scheme)  # fmt: skip
        return rows.to(self.dtype)  # [T, H]

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [S, H] -> [S, V] in hidden's dtype."""
        return quant_linear(hidden, self.weight, self.weight_scale, None, None, self.scheme)

    def load_shard(self, param: Tensor, tensor: Tensor, shard: str | None, name: str) -> None:
        with torch.no_grad():
            QuantLinear._load_int(self, param, tensor, name, 0, self.out_features)

    @property
    def scale(self) -> Tensor:
        return self.weight_scale

    def extra_repr(self) -> str:
        return f"vocab={self.out_features}, hidden={self.in_features}, scheme={self.scheme}"


# --------------------------------------------------------------------------- configuration


# Families whose every projection is a Linear / FusedLinear and whose op graph the quantized
# GEMM pass was tested on. MoE experts (StackedExperts) and MLA's projections are not built.
QUANTIZABLE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
QUANTIZATIONS = ("fp8",)  # what quantization= takes (vLLM's name)


@dataclass(frozen=True, slots=True)
class PackedFormat:
    """How an integer checkpoint packs its weights (models/quant_formats.py reads and writes
    them): kind one of "gptq" (AutoGPTQ v1: zero points stored minus one), "gptq_v2", "awq"
    (AutoAWQ gemm), "pack-quantized" (compressed-tensors); `bits` 4 or 8; `group` the
    checkpoint's columns a scale (None: per channel); symmetric or with zero points; act_order:
    a g_idx permutes the columns' groups."""

    kind: str
    bits: int
    group: int | None
    symmetric: bool
    act_order: bool

    def describe(self) -> dict:
        return {"kind": self.kind, "bits": self.bits, "group": self.group,
                "symmetric": self.symmetric, "act_order": self.act_order}  # fmt: skip


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """How a model is quantized: `method` ("compressed-tensors" or "fp8", from the checkpoint's
    quantization_config; "online-fp8" for quantization="fp8" over a model-dtype checkpoint),
    the scheme every quantized layer runs, the checkpoint name of the weight scale, and the
    modules left in the model dtype (exact names, or "re:" regular expressions, as
    compressed-tensors writes them; lm_head always)."""

    method: str
    scheme: QuantScheme
    scale_name: str = "weight_scale"
    ignore: tuple[str, ...] = ()
    # The token embedding's scheme when it stays quantized too (GGUF's Q8_0 token_embd, also
    # the tied lm_head): a QuantEmbedding. None: the embedding is in the model dtype.
    embedding: QuantScheme | None = None
    # An integer checkpoint's packing (GPTQ / AWQ / compressed-tensors pack-quantized): the
    # loader unpacks its tensors into the scheme's codes and scales (quant_formats).
    packing: PackedFormat | None = None

    @property
    def online(self) -> bool:
        return self.method == "online-fp8"

    def ignores(self, module_name: str) -> bool:
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module_name):
                    return True
            elif module_name == pattern or module_name.endswith("." + pattern):
                return True
        return False

    def describe(self) -> dict:
        """What the artifact manifest records and `inspect` shows."""
        return {
            "method": self.method,
            "scheme": str(self.scheme),
            "weight_scale": self.scheme.weight_scale,
            "block": list(self.scheme.block) if self.scheme.block else None,
            "activation": self.scheme.activation,
            "scale_name": self.scale_name,
            "ignore": list(self.ignore),
            "weight": self.scheme.weight,
            "group": self.scheme.group,
            "layout": self.scheme.layout,
            "embedding": str(self.embedding) if self.embedding is not None else None,
            # The checkpoint's packing, repacked at load into the scheme's layout above.
            "packing": self.packing.describe() if self.packing is not None else None,
        }


def quant_config(raw_config: dict, quantization: str | None) -> QuantConfig | None:
    """The QuantConfig of a checkpoint (its config.json as a dict) run with `quantization`
    (None, or "fp8": vLLM's online FP8 of a model-dtype checkpoint, dynamic per-token
    activations and per-channel weights; an FP8 checkpoint asked for "fp8" runs as saved).
    None: not quantized. Anything else is a QuantizationError naming the field."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise QuantizationError(
            f"quantization={quantization!r} is not supported; use one of {', '.join(QUANTIZATIONS)}"
        )
    section = raw_config.get("quantization_config")
    if section is None:
        if quantization is None:
            return None
        return QuantConfig("online-fp8", QuantScheme("channel", "token"))
    method = section.get("quant_method")
    if quantization is not None and method in ("gptq", "awq"):
        raise QuantizationError(f"quantization={quantization!r} over a {method} checkpoint")
    if method == "compressed-tensors":
        return _compressed_tensors(section)
    if method == "fp8":
        return _fp8_method(section)
    if method == "modelopt":
        return _modelopt(section)
    if method == "gptq":
        from compile_engine.models.quant_formats import gptq_config

        return gptq_config(section)
    if method == "awq":
        from compile_engine.models.quant_formats import awq_config

        return awq_config(section)
    raise QuantizationError(
        f"quantization_config.quant_method={method!r} is not supported; this engine loads "
        "'compressed-tensors' (FP8 float-quantized, int pack-quantized), 'fp8', 'modelopt' "
        "(FP8), 'gptq' and 'awq' checkpoints"
    )


def _compressed_tensors(section: dict) -> QuantConfig:
    where = "quantization_config"
    fmt = section.get("format")
    if fmt not in ("float-quantized", "naive-quantized", "pack-quantized"):
        raise QuantizationError(
            f"{where}.format={fmt!r} is not supported; FP8 checkpoints are 'float-quantized', "
            "int4 / int8 weight-only ones 'pack-quantized'"
        )
    groups = section.get("config_groups") or {}
    if len(groups) != 1:
        raise QuantizationError(
            f"{where}.config_groups has {len(groups)} groups; one FP8 group over Linear layers "
            "is supported"
        )
    (name, group), = groups.items()  # fmt: skip
    where = f"{where}.config_groups.{name}"
    if group.get("targets") != ["Linear"]:
        raise QuantizationError(f"{where}.targets={group.get('targets')!r}; want ['Linear']")
    weights = group.get("weights") or {}
    ignore = tuple(section.get("ignore") or ())
    if fmt == "pack-quantized":
        if group.get("input_activations") is not None:
            raise QuantizationError(f"{where}.input_activations: pack-quantized checkpoints run "
                                    "weight-only (W4A16 / W8A16)")  # fmt: skip
        from compile_engine.models.quant_formats import pack_quantized_config

        return pack_quantized_config(section, where, weights, ignore)
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise QuantizationError(
            f"{where}.weights: type {weights.get('type')!r}, num_bits {weights.get('num_bits')!r}"
            "; only 8-bit float (FP8 e4m3) weights are supported"
        )
    if weights.get("dynamic") or weights.get("symmetric") is False:
        raise QuantizationError(f"{where}.weights: want static symmetric FP8 weights")
    strategy = weights.get("strategy")
    block = None
    if strategy == "block":
        structure = weights.get("block_structure")
        if not (isinstance(structure, list) and len(structure) == 2):
            raise QuantizationError(f"{where}.weights.block_structure={structure!r}: want [n, k]")
        block = (int(structure[0]), int(structure[1]))
    elif strategy not in ("tensor", "channel"):
        raise QuantizationError(
            f"{where}.weights.strategy={strategy!r} is not supported; tensor, channel or block"
        )
    acts = group.get("input_activations")
    if acts is None:
        activation = "none"
    elif strategy == "block" and acts.get("strategy") == "group" and acts.get("dynamic"):
        # llm-compressor's FP8_BLOCK (1 x 128 activation groups): run W8A16, as the "fp8"
        # method's block checkpoints (_fp8_method says why).
        activation = "none"
    else:
        if acts.get("type") != "float" or acts.get("num_bits") != 8:
            raise QuantizationError(f"{where}.input_activations: only FP8 activations")
        kind = (acts.get("strategy"), bool(acts.get("dynamic")))
        activation = {("token", True): "token", ("tensor", False): "tensor"}.get(kind)
        if activation is None:
            raise QuantizationError(
                f"{where}.input_activations: strategy {kind[0]!r} with dynamic={kind[1]} is not "
                "supported; dynamic per-token or static per-tensor"
            )
    return QuantConfig(
        "compressed-tensors",
        QuantScheme(strategy, activation, block),
        ignore=tuple(section.get("ignore") or ()),
    )


def _fp8_method(section: dict) -> QuantConfig:
    where = "quantization_config"
    fmt = section.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(f"{where}.fmt={fmt!r} is not supported; e4m3")
    scheme_name = section.get("activation_scheme", "dynamic")
    block = section.get("weight_block_size")
    ignore = tuple(section.get("modules_to_not_convert") or section.get("ignored_layers") or ())
    if block is not None:
        if not (isinstance(block, list) and len(block) == 2):
            raise QuantizationError(f"{where}.weight_block_size={block!r}: want [n, k]")
        if scheme_name != "dynamic":
            raise QuantizationError(
                f"{where}.activation_scheme={scheme_name!r} with weight_block_size: only dynamic"
            )
        # Block weights run W8A16 here: the Triton GEMM applies the block scales per K-tile at
        # every row count, with the activation in the model dtype (more exact than the
        # checkpoint's own 1 x 128 activation groups, and a decode step is weight-bound).
        scheme = QuantScheme("block", "none", (int(block[0]), int(block[1])))
        return QuantConfig("fp8", scheme, scale_name="weight_scale_inv", ignore=ignore)
    activation = {"dynamic": "token", "static": "tensor"}.get(scheme_name)
    if activation is None:
        raise QuantizationError(
            f"{where}.activation_scheme={scheme_name!r}: one of 'dynamic', 'static'"
        )
    return QuantConfig("fp8", QuantScheme("tensor", activation), ignore=ignore)


def _modelopt(section: dict) -> QuantConfig:
    """NVIDIA ModelOpt's FP8 export: config.json's quantization_config with quant_method
    "modelopt", or hf_quant_config.json's "quantization" section (the loader folds it in):
    per-tensor e4m3 weights, each with a float32 `weight_scale`, and static per-tensor
    activations (`input_scale`), as vLLM's ModelOptFp8Config reads them. The attention
    layers' `k_proj.k_scale` / `v_proj.v_scale` (kv_cache_quant_algo FP8) are the FP8 KV
    cache's scales (models/loader.py); `exclude_modules` may hold shell-style wildcards."""
    where = "quantization_config"
    algo = section.get("quant_algo")
    if algo != "FP8":
        raise QuantizationError(
            f"{where}.quant_algo={algo!r} is not supported; ModelOpt checkpoints load as 'FP8' "
            "(per-tensor weights and static input scales)"
        )
    kv_algo = section.get("kv_cache_quant_algo")
    if kv_algo not in (None, "FP8"):
        raise QuantizationError(
            f"{where}.kv_cache_quant_algo={kv_algo!r} is not supported; 'FP8' or none"
        )
    patterns = section.get("exclude_modules") or section.get("ignore") or ()
    ignore = tuple(
        "re:" + fnmatch.translate(p) if any(c in p for c in "*?[") else p for p in patterns
    )
    return QuantConfig("modelopt", QuantScheme("tensor", "tensor"), ignore=ignore)


def quantized_layers(model: nn.Module, config: QuantConfig | None) -> dict | None:
    """The artifact manifest's record of a model's quantization: the config's `describe()` and
    the names of its QuantLinear layers (None when the model is not quantized)."""
    if config is None:
        return None
    kinds = (QuantLinear, QuantEmbedding)
    layers = [name for name, m in model.named_modules() if isinstance(m, kinds)]
    return {**config.describe(), "layers": layers}


def quantize_model(model: nn.Module, config: QuantConfig) -> list[str]:
    """Swap every Linear / FusedLinear of the model's decoder for a QuantLinear of the same
    shape (on the model's device: meta, before storage), except lm_head and what `config`
    ignores. Call after the model's dtype is set: FP8 and float32 scale parameters must not be
    cast to it. Returns the swapped modules' names."""
    arch = model.config.architecture
    if arch not in QUANTIZABLE:
        raise QuantizationError(
            f"FP8 quantization of {arch} is not supported; it runs {', '.join(QUANTIZABLE)} "
            "(MoE experts and MLA are not built)"
        )
    swapped = []
    for name, module in list(model.named_modules()):
        if type(module) not in (Linear, FusedLinear) or name == "lm_head":
            continue
        if config.ignores(name):
            continue
        out_features, in_features = module.weight.shape
        with torch.device(module.weight.device):  # meta: no storage for the new parameters
            replacement = QuantLinear(
                in_features,
                out_features,
                config.scheme,
                bias=module.bias is not None,
                dtype=module.weight.dtype,
                shards=module.shards if isinstance(module, FusedLinear) else None,
                scale_name=config.scale_name,
                online=config.online,
                act_order=config.packing is not None and config.packing.act_order,
            )
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, replacement)
        swapped.append(name)
    if not swapped:
        raise QuantizationError(f"no layer of {arch} was quantized (is the ignore list right?)")
    if config.embedding is not None:
        old = model.model.embed_tokens
        vocab, hidden = old.weight.shape
        with torch.device(old.weight.device):
            model.model.embed_tokens = QuantEmbedding(
                vocab, hidden, config.embedding, old.weight.dtype
            )
        swapped.append("model.embed_tokens")
    return swapped


def gguf_quant_config(types: dict[str, str], formats: dict[str, str], layout: str) -> QuantConfig:
    """The QuantConfig of a GGUF file read quantized: `types` its tensors' GGUF types by HF
    name, `formats` the GGUF types read as codes (gguf.QUANTIZED_TYPES: type -> weight format),
    `layout` the 4-bit layout to pack to. Every decoder projection must have one type (a mix,
    as Q4_K_M files hold, is refused); the embedding stays quantized if its type is read."""
    projections = {t for name, t in types.items() if is_quantized_checkpoint_weight(name)}
    if len(projections) != 1 or next(iter(projections)) not in formats:
        raise QuantizationError(
            f"GGUF projection types {sorted(projections)}: the quantized path runs files whose "
            f"projections are all one of {', '.join(formats)}; use --dtype float32 to run this "
            "file dequantized"
        )
    weight = formats[next(iter(projections))]
    if layout == "vnni_cpu":  # every format it holds, activations quantized per group
        scheme = QuantScheme("group", "int16_group", weight=weight, group=32, layout=layout)
    else:
        bits4 = weight.endswith("4")
        scheme = QuantScheme("group", "none", weight=weight, group=32,
                             layout=layout if bits4 else "plain")  # fmt: skip
    embd = formats.get(types.get("model.embed_tokens.weight", ""))
    embedding = QuantScheme("group", "none", weight=embd, group=32) if embd else None
    return QuantConfig("gguf", scheme, embedding=embedding)


# --------------------------------------------------------------------------- writing checkpoints

# FP8 checkpoint layouts `bench make-model --quantize` and the tests write: name -> (config of
# weights' scale, activation, block) as the formats spell them.
CHECKPOINT_LAYOUTS = (
    "ct-tensor", "ct-channel", "ct-block", "fp8-block", "fp8-tensor", "modelopt-fp8",
)  # fmt: skip
# The static input scale written for random-weight checkpoints (no calibration data): |x| up to 8.
STATIC_INPUT_SCALE = 8.0 / FP8_MAX


def _layout_scheme(layout: str, block: tuple[int, int]) -> tuple[QuantScheme, str]:
    if layout not in CHECKPOINT_LAYOUTS:
        raise QuantizationError(f"layout {layout!r}: one of {', '.join(CHECKPOINT_LAYOUTS)}")
    schemes = {
        "ct-tensor": (QuantScheme("tensor", "tensor"), "weight_scale"),
        "ct-channel": (QuantScheme("channel", "token"), "weight_scale"),
        "ct-block": (QuantScheme("block", "none", block), "weight_scale"),
        "fp8-block": (QuantScheme("block", "none", block), "weight_scale_inv"),
        "fp8-tensor": (QuantScheme("tensor", "token"), "weight_scale"),
        "modelopt-fp8": (QuantScheme("tensor", "tensor"), "weight_scale"),
    }
    return schemes[layout]


def is_quantized_checkpoint_weight(name: str) -> bool:
    """The checkpoint tensors an FP8 checkpoint of a Llama-family model quantizes: the decoder
    projections' weights (not lm_head, embeddings or norms)."""
    return ".layers." in name and name.endswith("_proj.weight")


def quantize_checkpoint_tensor(
    name: str, tensor: Tensor, layout: str, block: tuple[int, int] = (128, 128)
) -> dict[str, Tensor]:
    """One checkpoint tensor as `layout` stores it: a projection weight becomes its FP8 weight
    and scale(s) (and a static input scale), anything else stays as it is."""
    if not is_quantized_checkpoint_weight(name):
        return {name: tensor}
    scheme, scale_name = _layout_scheme(layout, block)
    prefix = name.removesuffix(".weight")
    w = tensor.float()
    if scheme.weight_scale == "tensor":
        scale = w.abs().amax().clamp_min(MIN_SCALE) / FP8_MAX
        stored_scale = scale.reshape(1)
    elif scheme.weight_scale == "channel":
        scale = w.abs().amax(dim=1, keepdim=True).clamp_min(MIN_SCALE) / FP8_MAX  # [N, 1]
        stored_scale = scale
    else:
        bn, bk = block
        n, k = w.shape
        padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk, dtype=w.dtype, device=w.device)
        padded[:n, :k] = w
        tiles = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
        stored_scale = tiles.abs().amax(dim=(1, 3)).clamp_min(MIN_SCALE) / FP8_MAX
        scale = expand_scale(stored_scale, (n, k), scheme)
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    out = {name: q, f"{prefix}.{scale_name}": stored_scale.float().contiguous()}
    if scheme.activation == "tensor":
        out[f"{prefix}.input_scale"] = torch.tensor([STATIC_INPUT_SCALE], dtype=torch.float32)
    if layout == "modelopt-fp8":
        # ModelOpt's scalars are 0-d, and its k_proj / v_proj carry the FP8 KV cache's scales
        # (1.0 here: random weights have no calibration data).
        out = {k: v.reshape(()) if v.numel() == 1 and k != name else v for k, v in out.items()}
        for proj, kv in (("k_proj", "k_scale"), ("v_proj", "v_scale")):
            if prefix.endswith(f".self_attn.{proj}"):
                out[f"{prefix}.{kv}"] = torch.tensor(1.0, dtype=torch.float32)
    return out


def checkpoint_quantization_config(layout: str, block: tuple[int, int] = (128, 128)) -> dict:
    """The config.json `quantization_config` of an FP8 checkpoint written as `layout`."""
    scheme, _ = _layout_scheme(layout, block)
    if layout == "modelopt-fp8":  # the form newer ModelOpt exports put in config.json
        return {
            "quant_method": "modelopt",
            "quant_algo": "FP8",
            "kv_cache_quant_algo": "FP8",
            "exclude_modules": ["lm_head"],
            "producer": {"name": "modelopt"},
        }
    if layout.startswith("fp8-"):
        section = {"quant_method": "fp8", "fmt": "e4m3"}
        section["activation_scheme"] = "dynamic"
        if scheme.block is not None:
            section["weight_block_size"] = list(block)
        return section
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
    weights["strategy"] = scheme.weight_scale
    if scheme.block is not None:
        weights["block_structure"] = list(block)
    acts = None
    if scheme.activation == "token":
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True}
        acts["strategy"] = "token"
    elif scheme.activation == "tensor":
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
        acts["strategy"] = "tensor"
    elif scheme.block is not None:  # llm-compressor's FP8_BLOCK: 1 x 128 activation groups
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True}
        acts.update(strategy="group", group_size=block[1])
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}
        },
        "ignore": ["lm_head"],
    }
