"""FP8 linear layers on Hopper: what the quantized_gemm pass lowers `ce.quant_linear` to.

`ce_kernels::fp8_linear(x, x_scale, weight, weight_scale, bias, scheme, out_dtype, tuning_key)`
takes the activation already quantized where the scheme quantizes it (x e4m3 with x_scale, one
a row or one for all): the pass puts a `ce.quantize_fp8` node in front, which
lower_to_reference hands Inductor as its reference, so the row's amax and the cast fuse into
the kernel that produces the activation (the add + rms_norm, silu_and_mul) rather than costing
a launch of their own per linear. A W8A16 scheme (activation "none", block-scaled checkpoints)
passes x in the model dtype and no scale. Per call, by the row count (inside a CUDA graph the
choice is made once, at capture):

- At most SKINNY_MAX_ROWS (16) rows, and at every row count for block scales or W8A16: the
  skinny GEMM (kernels_generated/skinny_gemm.py) streaming e4m3 weight tiles into FP8 tensor
  cores (wgmma e4m3 x e4m3; W8A16 upcasts the weight tile to the activation's dtype in
  registers), the scales in the epilogue and a block scale per K-tile. A decode step of a few
  rows is bound by the weight's read, and FP8 halves it. Launch configs per (N, K, rows) from
  configs/fp8_gemm.json ("skinny" default where untuned; "tiles", tensor-core tiles, above 16
  rows: not swept).
- Above 16 rows, per-tensor or per-channel weights with FP8 activations: `torch._scaled_mm`,
  tensor-wise scales where both are one scale (1.64-1.77x bf16 on the H200, BRIEF.md), row-wise
  ([M, 1] x [1, N]) otherwise (1.26-1.70x from 64 rows).

Measured in the first version (a366a76, H200, `bench fp8-gemm`): with the activation left in
bf16 at <= 16 rows (W8A16), the weight tile's upcast (e4m3 -> f16 -> bf16, one element at a
time, after 2-byte shared-memory reads) held the kernel to the bf16 kernel's element rate: qkv
18.6 us against bf16's 15.2, gate_up 51.7 against 55.5, down 24.9 against 29.6; batch 1 decoded
238.8 tok/s against bf16's 250.6. The e4m3 x e4m3 dot loads both tiles by 16-byte async copies
straight into the wgmma (an offline sm_90 compile: 593 PTX instructions a loop body against
1,224).

`fp8_linear_ref` is the lowering's oracle: the dequantized product in float32. With the
activation quantized by `quantize_fp8_ref`, the two compose to exactly `quant_linear_ref`.
On CPU nothing here runs: the Triton interpreter cannot cast FP8, and the pass lowers
quant_linear to its reference on the cpu target.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor

from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.configs import bucket_tokens
from compile_engine.kernels_generated.skinny_gemm import (
    Fp8Operands,
    LaunchConfig,
    SkinnyGemmError,
    _launch,
    _validate,
)
from compile_engine.kernels_generated.tuning import KernelConfig
from compile_engine.models.quant import QuantScheme, expand_scale

SKINNY_MAX_ROWS = 16  # the decode rows the skinny GEMM streams the FP8 weight for


@functools.cache
def skinny_config(tuning_key: str, n_size: int, k_size: int, rows_bucket: int) -> LaunchConfig:
    """The tuned launch config for this weight and row bucket (nearest M among entries of
    exactly this (N, K)); the table's skinny default where none was tuned."""
    table = tuning.resolve(tuning_key).table("fp8_gemm")
    section = table.targets.get("h100")
    entries = [
        e
        for e in (section.entries if section else [])
        if e.key["N"] == n_size and e.key["K"] == k_size
    ]
    if not entries:
        return LaunchConfig(**table.default["skinny"])
    best = min(entries, key=lambda e: abs(e.key["M"].bit_length() - rows_bucket.bit_length()))
    return LaunchConfig(**best.config)


def _fit_block(config: LaunchConfig, scheme: QuantScheme) -> LaunchConfig:
    """A config whose K-tiles lie in one scale block each (block scales only): block_k
    halved until it divides the block's columns. A tuned entry of a block-scaled shape already
    does; the shared defaults may not."""
    if scheme.block is None:
        return config
    block_k = config.block_k
    while scheme.block[1] % block_k and block_k > 16:
        block_k //= 2
    return config if block_k == config.block_k else dataclasses.replace(config, block_k=block_k)


def fp8_linear_ref(
    x: Tensor,
    x_scale: Tensor | None,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    scheme: str,
    out_dtype: torch.dtype,
) -> Tensor:
    """What `fp8_linear` computes: (x * x_scale) @ (weight * weight_scale)^T (+ bias) in
    float32, rounded to out_dtype; x in the model dtype and no x_scale for W8A16."""
    parsed = QuantScheme.parse(scheme)
    xf = x.float() if x_scale is None else x.float() * x_scale.float()
    w = weight.float() * expand_scale(weight_scale, tuple(weight.shape), parsed)
    out = xf @ w.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def run_fp8_linear(
    kernel_config: KernelConfig,
    x: Tensor,
    x_scale: Tensor | None,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    scheme: str,
    out_dtype: torch.dtype,
) -> Tensor:
    """fp8_linear with an explicit kernel config (module docstring)."""
    parsed = QuantScheme.parse(scheme)
    flat = x.reshape(-1, x.shape[-1])
    rows, k_size = flat.shape
    n_size = weight.shape[0]
    _validate(flat, weight, fp8=True)
    if (x_scale is None) != (parsed.activation == "none"):
        raise SkinnyGemmError(
            f"scheme {scheme}: the activation comes {'without' if x_scale is None else 'with'} "
            "a scale; quantized_gemm quantizes it exactly where the scheme does"
        )
    if (x_scale is None) == (flat.dtype == torch.float8_e4m3fn):
        raise SkinnyGemmError(f"an activation of {flat.dtype} with x_scale {x_scale is not None}")
    scales = None
    if x_scale is not None:
        scales = x_scale.float().reshape(-1)  # [M] a row, or [1]
        if scales.numel() not in (1, rows):
            raise SkinnyGemmError(f"{scales.numel()} activation scales for {rows} rows")
    if rows <= SKINNY_MAX_ROWS or x_scale is None or parsed.weight_scale == "block":
        if rows <= SKINNY_MAX_ROWS:
            config = skinny_config(kernel_config.key, n_size, k_size, bucket_tokens(max(rows, 1)))
        else:  # block scales or W8A16 above the skinny rows: tensor-core tiles
            config = LaunchConfig(**kernel_config.table("fp8_gemm").default["tiles"])
        operands = Fp8Operands(weight_scale, parsed.weight_scale, out_dtype, scales, parsed.block)
        out = _launch(flat, weight, None, _fit_block(config, parsed), kernel_config, fp8=operands)[
            0
        ]
    else:
        if parsed.weight_scale == "tensor" and scales.numel() == 1:
            scale_a, scale_b = scales.reshape(()), weight_scale.float().reshape(())
        else:  # row-wise: [M, 1] x [1, N]
            scale_a = scales.reshape(-1, 1).expand(rows, 1).contiguous()
            scale_b = weight_scale.float().reshape(1, -1).expand(1, n_size).contiguous()
        out = torch._scaled_mm(
            flat.contiguous(), weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype
        )
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], n_size)


# The op the quantized_gemm pass swaps in for ce.quant_linear on h100: opaque to Dynamo and
# Inductor, one call in the CUDA graph. `tuning_key` is the key of the engine's KernelConfig.
@torch.library.custom_op("ce_kernels::fp8_linear", mutates_args=())
def fp8_linear(
    x: Tensor,
    x_scale: Tensor | None,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    scheme: str,
    out_dtype: torch.dtype,
    tuning_key: str,
) -> Tensor:
    """`run_fp8_linear` with the kernel config whose key the pass gave."""
    if not x.is_cuda:
        raise SkinnyGemmError(
            "ce_kernels::fp8_linear runs on CUDA only; on cpu the quantized_gemm pass lowers "
            "quant_linear to its reference"
        )
    return run_fp8_linear(
        tuning.resolve(tuning_key), x, x_scale, weight, weight_scale, bias, scheme, out_dtype
    )


@fp8_linear.register_fake
def _fp8_linear_fake(
    x: Tensor,
    x_scale: Tensor | None,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    scheme: str,
    out_dtype: torch.dtype,
    tuning_key: str,
) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype)
