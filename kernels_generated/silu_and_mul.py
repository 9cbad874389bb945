"""silu_and_mul in plain Triton: x [T, 2I] holding [gate | up] -> silu(gate) * up, [T, I].

Lowers `ce::silu_and_mul` (reference: `models.ops.silu_and_mul_ref`), the hand-written
counterpart of the Helion kernel in silu_and_mul_helion.py, so that `bench fusions` compares
Helion's generated tiling, a plain one and Inductor's fusion of the reference on one footing.
Bound by memory bandwidth: one read of 2I and one write of I elements per token.

Grid `(T, cdiv(I, BLOCK))`: a program reads BLOCK gate and BLOCK up elements of one token
(x's row stride, no copy of the halves) and writes BLOCK outputs. Rounding follows the
reference (HF's `F.silu(gate) * up` in the activation dtype): silu as ATen computes it,
`g / (1 + exp(-g))` in float32, rounded to the activation dtype, then the product in that
dtype. exp's last float32 bit may differ from ATen's, moving a result by one ulp at most.

Measured on the H200 (`compile-engine bench fusions`, I = 14336, bf16, CUDA-graph replay):
1.21 / 1.93 / 3.65 / 43.43 us at T = 1 / 64 / 256 / 2048; against Inductor's fusion of the
reference a tie at one token and at 2048, ahead at 64 and 256.

BLOCK and num_warps per target and shape class {I, T bucketed} live in configs/silu_and_mul.json
(nearest key); `compile-engine bench kernel silu_and_mul [--tune]` checks, times and tunes the
kernel (benchmarks/kernel_harness.py). On CPU the kernel runs only under the Triton interpreter
(`TRITON_INTERPRET=1`), in float32 or float16.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.configs import TARGET_OF_DEVICE, bucket_tokens
from compile_engine.kernels_generated.device import pdl_launch, pdl_on
from compile_engine.kernels_generated.tuning import KernelConfig
from compile_engine.models.ops import silu_and_mul_fake


class SiluAndMulKernelError(RuntimeError):
    """The Triton silu_and_mul kernel cannot run these inputs here; the message says why."""


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2I], unit last stride
    out_ptr,  # [T, I], unit last stride
    inter,
    stride_xt,
    stride_ot,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,  # a PDL dependent: waits for the kernel ahead, releases the next
    # after its loads (tuning.py)
):
    if PDL:
        tl.extra.cuda.gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    row = x_ptr + token * stride_xt
    gate = tl.load(row + cols, mask=mask, other=0.0)
    up = tl.load(row + inter + cols, mask=mask, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    g = gate.to(tl.float32)
    activated = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu, rounded as the reference
    out = activated.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + token * stride_ot + cols, out.to(gate.dtype), mask=mask)


INTERPRETED = not isinstance(_silu_and_mul_kernel, JITFunction)
"""True when triton was imported with TRITON_INTERPRET=1: the kernel then runs on CPU tensors."""


def shape_key(num_tokens: int, inter: int) -> dict[str, int]:
    return {"I": inter, "T": bucket_tokens(num_tokens)}


@functools.cache
def config_for(tuning_key: str, target: str, tokens_bucket: int, inter: int) -> dict:
    """The launch config of a shape class in the kernel config's table (cached: looked up once
    per class, not per call)."""
    table = tuning.resolve(tuning_key).table("silu_and_mul")
    return table.lookup(target, {"I": inter, "T": tokens_bucket})


def silu_and_mul_triton(
    x: Tensor,
    *,
    block: int | None = None,
    num_warps: int | None = None,
    kernel_config: KernelConfig | None = None,
) -> Tensor:
    """Same contract as `models.ops.silu_and_mul`. The launch config comes from kernel_config's
    table, PDL from its settings (None: the defaults); block / num_warps override the config."""
    if x.device.type == "cpu" and not INTERPRETED:
        raise SiluAndMulKernelError(
            "the Triton silu_and_mul kernel runs on CPU tensors only under the interpreter: "
            "set TRITON_INTERPRET=1 before triton is first imported, or leave the pass off"
        )
    if x.device.type == "cpu" and x.dtype == torch.bfloat16:
        raise SiluAndMulKernelError(
            "the Triton interpreter computes bfloat16 wrongly; use float32 or float16 on CPU"
        )
    if x.shape[-1] % 2:
        raise SiluAndMulKernelError(f"last dim {x.shape[-1]} is odd: want [..., 2I]")
    out = silu_and_mul_fake(x)
    flat = x.reshape(-1, x.shape[-1])  # [T, 2I], a view for the model's 2-D activations
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    num_tokens, inter = flat.shape[0], flat.shape[1] // 2
    if num_tokens == 0 or inter == 0:
        return out
    out_flat = out.view(num_tokens, inter)  # the fake's new_empty is contiguous
    kernel_config = kernel_config or tuning.default()
    target = TARGET_OF_DEVICE[x.device.type]
    config = config_for(kernel_config.key, target, bucket_tokens(num_tokens), inter)
    block = block or config["BLOCK"]
    pdl = pdl_on(kernel_config, x.device, num_tokens)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            flat,
            out_flat,
            inter,
            flat.stride(0),
            out_flat.stride(0),
            BLOCK=block,
            PDL=pdl,
            num_warps=num_warps or config["num_warps"],
            **pdl_launch(pdl),
        )
    return out


# The op the silu_and_mul_triton pass swaps in for ce::silu_and_mul: its schema and the kernel
# config's key (tuning.py).
@torch.library.custom_op("ce_kernels::silu_and_mul", mutates_args=())
def silu_and_mul(x: Tensor, tuning_key: str) -> Tensor:
    """`ce::silu_and_mul` computed by the Triton kernel."""
    return silu_and_mul_triton(x, kernel_config=tuning.resolve(tuning_key))


@silu_and_mul.register_fake
def _silu_and_mul_kernel_fake(x: Tensor, tuning_key: str) -> Tensor:
    return silu_and_mul_fake(x)
