"""FP8 linear layers on Hopper: what the quantized_gemm pass lowers `ce.quant_linear` to.

`ce_kernels::fp8_linear(x, weight, weight_scale, input_scale, bias, scheme, tuning_key)` runs
one of two GEMMs per call, by the row count (inside a CUDA graph the choice is made once, at
capture):

- At most SKINNY_MAX_ROWS (16) rows, and at every row count for block scales or a W8A16 scheme:
  the skinny GEMM (kernels_generated/skinny_gemm.py) streaming e4m3 weight tiles, upcast in
  registers, the per-tensor / per-channel scale applied in the epilogue and a block scale per
  K-tile. A decode step of a few rows is bound by the weight's read, and FP8 halves it. At
  these rows the activation stays in the model dtype (W8A16) whatever the scheme says: a
  per-token quantization would cost a launch (or a second read of the rows in every program)
  to save nothing, since the activation is a few KB against tens of MB of weight. Above 16
  rows a block-scaled or W8A16 GEMM runs the same kernel with tensor-core tiles
  (`fp8_gemm.json`'s "tiles" default: not swept), the activation quantized as the scheme says.
- Above 16 rows, per-tensor or per-channel weights with FP8 activations: the activation is
  quantized (dynamic per token by `_quantize_rows`, one launch, or by the static scale) and
  `torch._scaled_mm` multiplies on FP8 tensor cores, tensor-wise scales where both are one
  scale (1.64-1.77x bf16 on the H200, BRIEF.md), row-wise ([M, 1] x [1, N]) otherwise
  (1.26-1.70x from 64 rows).

`fp8_linear_ref` is the lowering's oracle: `quant_linear_ref` with the activation left
unquantized where the skinny GEMM runs, the scheme's own elsewhere.

Configs: configs/fp8_gemm.json, keyed by the weight's (N, K) and the rows' power-of-two bucket,
written by `compile-engine bench fp8-gemm --write-configs` (benchmarks/fp8_gemm.py). On CPU
nothing here runs: the Triton interpreter cannot cast FP8, and the pass lowers quant_linear to
its reference on the cpu target.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
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
from compile_engine.models.quant import FP8_DTYPE, FP8_MAX, MIN_SCALE, QuantScheme, quant_linear_ref

SKINNY_MAX_ROWS = 16  # the decode rows whose GEMM streams the FP8 weight with x in bf16
_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, static_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr,
    STATIC: tl.constexpr,
):  # fmt: skip
    """One program a row: its amax (dynamic) or the static scale, then q = x / scale in e4m3,
    saturated at +-448, and the scale stored (float32)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if STATIC:
        scale = tl.load(static_ptr)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(0, K, BLOCK):
            v = tl.load(x_ptr + row * stride_x + k + offs, mask=k + offs < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
        scale = tl.maximum(tl.max(amax, axis=0), _MIN_SCALE) / _MAX
        tl.store(scale_ptr + row, scale)
    for k in range(0, K, BLOCK):
        v = tl.load(x_ptr + row * stride_x + k + offs, mask=k + offs < K, other=0.0)
        q = tl.clamp(v.to(tl.float32) / scale, -_MAX, _MAX)
        tl.store(q_ptr + row * stride_q + k + offs, q.to(q_ptr.dtype.element_ty), mask=k + offs < K)


def quantize_rows(x: Tensor, static_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (q [M, K] e4m3, scale): per row ([M] float32) or the static one; what
    `quantize_fp8_ref` computes, in one launch."""
    rows, k_size = x.shape
    q = torch.empty_like(x, dtype=FP8_DTYPE)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        static = static_scale.float().reshape(()) if static_scale is not None else scale
        _quantize_rows_kernel[(rows,)](
            x, q, scale, static, k_size, x.stride(0), q.stride(0),
            BLOCK=min(4096, triton.next_power_of_2(k_size)), STATIC=static_scale is not None,
            num_warps=4,
        )  # fmt: skip
    if static_scale is not None:
        return q, static_scale.float().reshape(())
    return q, scale


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
    weight: Tensor,
    weight_scale: Tensor,
    input_scale: Tensor | None,
    bias: Tensor | None,
    scheme: str,
) -> Tensor:
    """What `fp8_linear` computes: `quant_linear_ref`, the activation unquantized where the
    skinny GEMM runs it in the model dtype (module docstring)."""
    parsed = QuantScheme.parse(scheme)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if _skinny(rows, parsed):
        scheme = str(QuantScheme(parsed.weight_scale, "none", parsed.block, parsed.weight))
    return quant_linear_ref(x, weight, weight_scale, input_scale, bias, scheme)


def _skinny(rows: int, scheme: QuantScheme) -> bool:
    """Whether `rows` rows run the skinny GEMM with the activation in the model dtype."""
    return rows <= SKINNY_MAX_ROWS or scheme.activation == "none"


def run_fp8_linear(
    kernel_config: KernelConfig,
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    input_scale: Tensor | None,
    bias: Tensor | None,
    scheme: str,
) -> Tensor:
    """fp8_linear with an explicit kernel config (module docstring)."""
    parsed = QuantScheme.parse(scheme)
    flat = x.reshape(-1, x.shape[-1])
    rows, k_size = flat.shape
    n_size = weight.shape[0]
    _validate(flat, weight, fp8=True)
    if _skinny(rows, parsed) or parsed.weight_scale == "block":
        if _skinny(rows, parsed):
            config = skinny_config(kernel_config.key, n_size, k_size, bucket_tokens(max(rows, 1)))
            x_q, x_scale = flat, None
        else:  # block scales above the skinny rows: tensor-core tiles, FP8 activations
            table = kernel_config.table("fp8_gemm")
            config = LaunchConfig(**table.default["tiles"])
            static = input_scale if parsed.activation == "tensor" else None
            x_q, x_scale = quantize_rows(flat, static)
        operands = Fp8Operands(weight_scale, parsed.weight_scale, x.dtype, x_scale, parsed.block)
        config = _fit_block(config, parsed)
        out = _launch(x_q, weight, None, config, kernel_config, fp8=operands)[0]
    else:
        static = input_scale if parsed.activation == "tensor" else None
        x_q, x_scale = quantize_rows(flat, static)
        if parsed.weight_scale == "tensor" and parsed.activation == "tensor":
            scale_a, scale_b = x_scale, weight_scale.float().reshape(())
        else:  # row-wise: [M, 1] x [1, N]
            scale_a = x_scale.reshape(-1, 1).expand(rows, 1).contiguous()
            scale_b = weight_scale.float().reshape(1, -1).expand(1, n_size).contiguous()
        out = torch._scaled_mm(x_q, weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], n_size)


# The op the quantized_gemm pass swaps in for ce.quant_linear on h100: opaque to Dynamo and
# Inductor, one call in the CUDA graph. `tuning_key` is the key of the engine's KernelConfig.
@torch.library.custom_op("ce_kernels::fp8_linear", mutates_args=())
def fp8_linear(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    input_scale: Tensor | None,
    bias: Tensor | None,
    scheme: str,
    tuning_key: str,
) -> Tensor:
    """`run_fp8_linear` with the kernel config whose key the pass gave."""
    if not x.is_cuda:
        raise SkinnyGemmError(
            "ce_kernels::fp8_linear runs on CUDA only; on cpu the quantized_gemm pass lowers "
            "quant_linear to its reference"
        )
    return run_fp8_linear(
        tuning.resolve(tuning_key), x, weight, weight_scale, input_scale, bias, scheme
    )


@fp8_linear.register_fake
def _fp8_linear_fake(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    input_scale: Tensor | None,
    bias: Tensor | None,
    scheme: str,
    tuning_key: str,
) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
