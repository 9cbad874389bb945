"""rms_norm and residual-add + rms_norm in Triton: one row per program, float32 accumulation.

Lowers `ce::rms_norm` and `ce::add_rms_norm` (references: `models.ops.rms_norm_ref`,
`add_rms_norm_ref`). Both are bound by memory bandwidth: add_rms_norm reads x, the residual
and the weight and writes the normalised row and the new residual (4 T H elements), rms_norm
reads x and writes one row (2 T H). A program owns one row of H elements, held in registers as
one tile (H up to 65536), so each element is read once and written once.

Rounding follows the reference, which follows HF: the residual sum is rounded to the
activation dtype (it is the residual stream the next layer reads), the mean of squares and
rsqrt are in float32, the normalised row is rounded to the activation dtype and then multiplied
by the weight in that dtype. Only the float32 sum's order (a tree here, ATen's own order there)
and rsqrt's last bit differ, which can move a result by one ulp of the activation dtype.

Rows: x is [..., H]; a 2-D x gives rows of stride x.stride(0), a 3-D x (Qwen3's q/k norm over
[T, heads, D], a strided view of the QKV output) gives rows by (outer, inner) strides, so
neither is copied. Outputs are `torch.empty_like(x)`, exactly what the op's fake promises.

Measured on the H200 (`compile-engine bench fusions`, add_rms_norm at hidden 4096, bf16,
CUDA-graph replay): 1.71 / 1.87 / 2.60 / 17.94 us at T = 1 / 64 / 256 / 2048 (3.7 TB/s at
2048), a tie with Inductor's fusion of the reference, which is also one row per program.

Configs (num_warps) per target and shape class {H, T = rows bucketed to a power of two} live
in configs/add_rms_norm.json, picked by nearest key (kernels_generated/configs.py); `compile-
engine bench kernel add_rms_norm` checks and times the kernel, `--tune` measures the configs
(benchmarks/kernel_harness.py). On CPU the kernel runs only under the Triton interpreter
(`TRITON_INTERPRET=1` before triton is first imported), which computes bf16 wrongly, so CPU
tensors must be float32 or float16.
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
from compile_engine.kernels_generated.tuning import KernelConfig
from compile_engine.models.ops import (
    add_rms_norm_fake,
    rms_norm_fake,
)

MAX_HIDDEN = 65536  # one tile per row: past this the registers spill (no model comes close)
# A CUDA device is taken to be an H100/H200 (sm_90), the only GPU target.


class RmsNormKernelError(RuntimeError):
    """The Triton rms_norm kernel cannot run these inputs here; the message says why."""


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,  # unused without HAS_RESIDUAL
    weight_ptr,
    out_ptr,
    residual_out_ptr,  # unused without HAS_RESIDUAL
    rows_inner,  # rows per outer index: 1 for a 2-D x, x.shape[1] for a 3-D x
    stride_x_outer,
    stride_x_inner,
    stride_r_outer,
    stride_r_inner,
    stride_o_outer,
    stride_o_inner,
    stride_ro_outer,
    stride_ro_inner,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: T * H passes 2**31 at long prefills
    outer = row // rows_inner
    inner = row % rows_inner
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + outer * stride_x_outer + inner * stride_x_inner + cols, mask=mask)
    # Cast to float32 right after loading: the interpreter computes bf16 arithmetic wrongly,
    # and on the GPU a bf16 add is a float32 add rounded anyway.
    xf = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(
            residual_ptr + outer * stride_r_outer + inner * stride_r_inner + cols, mask=mask
        )
        # The sum is rounded to the activation dtype, as the reference's `x + residual` is:
        # that rounded stream is what the norm sees and what the next layer adds to.
        summed = (xf + r.to(tl.float32)).to(x.dtype)
        tl.store(
            residual_out_ptr + outer * stride_ro_outer + inner * stride_ro_inner + cols,
            summed,
            mask=mask,
        )
        xf = summed.to(tl.float32)
    mean_square = tl.sum(xf * xf, axis=0) / hidden  # masked lanes loaded as 0
    normed = (xf * tl.rsqrt(mean_square + eps)).to(x.dtype)  # HF rounds before the weight
    w = tl.load(weight_ptr + cols, mask=mask)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(
        out_ptr + outer * stride_o_outer + inner * stride_o_inner + cols,
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


INTERPRETED = not isinstance(_rms_norm_kernel, JITFunction)
"""True when triton was imported with TRITON_INTERPRET=1: the kernel then runs on CPU tensors."""


# --------------------------------------------------------------------------- configs


INVARIANT_ROWS = 16  # launches of at most this many rows share the one-row config


def shape_key(num_rows: int, hidden: int) -> dict[str, int]:
    return {"H": hidden, "T": bucket_tokens(num_rows)}


@functools.cache
def config_for(tuning_key: str, target: str, rows_bucket: int, hidden: int) -> dict:
    """The launch config of a shape class in the kernel config's table (cached: looked up once
    per class, not per call)."""
    table = tuning.resolve(tuning_key).table("add_rms_norm")
    return table.lookup(target, {"H": hidden, "T": rows_bucket})


# --------------------------------------------------------------------------- launcher


def _rows(t: Tensor) -> tuple[int, int, int]:
    """(rows_inner, outer stride, inner stride) addressing the rows of a 2-D or 3-D tensor."""
    if t.dim() == 2:
        return 1, t.stride(0), 0
    return t.shape[1], t.stride(0), t.stride(1)


def _validate(x: Tensor, weight: Tensor, residual: Tensor | None) -> None:
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise RmsNormKernelError(f"weight {tuple(weight.shape)} does not match x [..., {hidden}]")
    if residual is not None and residual.shape != x.shape:
        raise RmsNormKernelError(
            f"residual {tuple(residual.shape)} and x {tuple(x.shape)} differ in shape"
        )
    if hidden > MAX_HIDDEN:
        raise RmsNormKernelError(
            f"hidden size {hidden} is above the kernel's {MAX_HIDDEN} (one tile per row); "
            "leave the rms_norm_triton pass off (--passes -rms_norm_triton)"
        )
    if x.device.type == "cpu" and not INTERPRETED:
        raise RmsNormKernelError(
            "the Triton rms_norm kernel runs on CPU tensors only under the interpreter: set "
            "TRITON_INTERPRET=1 before triton is first imported, or leave the pass off on cpu"
        )
    if x.device.type == "cpu" and x.dtype == torch.bfloat16:
        raise RmsNormKernelError(
            "the Triton interpreter computes bfloat16 wrongly; use float32 or float16 on CPU"
        )


def _flat_rows(t: Tensor) -> Tensor:
    """A 2-D or 3-D view with a unit last stride, which the kernel addresses without a copy;
    anything else (more dims, a strided last dim) is copied once."""
    if t.dim() in (2, 3) and t.stride(-1) == 1:
        return t
    return t.reshape(-1, t.shape[-1]).contiguous()


def rms_norm_triton(
    x: Tensor,
    weight: Tensor,
    eps: float,
    residual: Tensor | None = None,
    *,
    num_warps: int | None = None,
    kernel_config: KernelConfig | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """rms_norm(x) or, with `residual`, (rms_norm(x + residual), x + residual); the same
    contract as `models.ops.rms_norm` / `add_rms_norm`. The launch config comes from
    kernel_config's table (None: the defaults); num_warps overrides it."""
    _validate(x, weight, residual)
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else None
    hidden = x.shape[-1]
    num_rows = x.numel() // hidden if hidden else 0
    if num_rows == 0:
        return out if residual_out is None else (out, residual_out)

    # The kernel writes through (outer, inner) strides with a unit last stride; an output that
    # empty_like laid out otherwise is computed into a contiguous buffer and copied back.
    direct = out.dim() in (2, 3) and out.stride(-1) == 1
    x_k = _flat_rows(x)
    r_k = _flat_rows(residual) if residual is not None else x_k
    out_k = out if direct else torch.empty(x_k.shape, dtype=x.dtype, device=x.device)
    ro_k = out_k  # unused without a residual
    if residual_out is not None:
        ro_k = residual_out if direct else torch.empty_like(out_k)
    if not (x_k.dim() == r_k.dim() == out_k.dim() == ro_k.dim()):
        x_k, r_k = x_k.reshape(-1, hidden), r_k.reshape(-1, hidden)
        out_k, ro_k = out_k.view(-1, hidden), ro_k.view(-1, hidden)

    target = TARGET_OF_DEVICE[x.device.type]
    kernel_config = kernel_config or tuning.default()
    # Up to 16 rows take the one-row config: its warps set the sum's reduction tree, and a
    # speculative verification step's rows must be normalised as one-row decode's are, bit
    # for bit (issue 33; the nearest tuned entry of another width had 1 warp at 8 rows, 8 at 1).
    rows_bucket = 1 if num_rows <= INVARIANT_ROWS else bucket_tokens(num_rows)
    config = config_for(kernel_config.key, target, rows_bucket, hidden)
    rows_inner, sxo, sxi = _rows(x_k)
    _, sro, sri = _rows(r_k)
    _, soo, soi = _rows(out_k)
    _, sroo, sroi = _rows(ro_k)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _rms_norm_kernel[(num_rows,)](
            x_k,
            r_k,
            weight,
            out_k,
            ro_k,
            rows_inner,
            sxo,
            sxi,
            sro,
            sri,
            soo,
            soi,
            sroo,
            sroi,
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(hidden),
            num_warps=num_warps or config["num_warps"],
        )
    if not direct:
        out.copy_(out_k.view(x.shape))
        if residual_out is not None:
            residual_out.copy_(ro_k.view(x.shape))
    return out if residual_out is None else (out, residual_out)


# The ops the rms_norm_triton pass swaps in for ce::rms_norm and ce::add_rms_norm: their
# schemas and the kernel config's key (tuning.py), opaque to Dynamo and Inductor
# (torch.library.triton_op fails under torch.compile on CPU, where the interpreter would run
# on fake tensors).
@torch.library.custom_op("ce_kernels::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float, tuning_key: str) -> Tensor:
    """`ce::rms_norm` computed by the Triton kernel."""
    return rms_norm_triton(x, weight, eps, kernel_config=tuning.resolve(tuning_key))


@rms_norm.register_fake
def _rms_norm_kernel_fake(x: Tensor, weight: Tensor, eps: float, tuning_key: str) -> Tensor:
    return rms_norm_fake(x, weight, eps)


@torch.library.custom_op("ce_kernels::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, tuning_key: str
) -> tuple[Tensor, Tensor]:
    """`ce::add_rms_norm` computed by the Triton kernel: (rms_norm(x + r), x + r)."""
    return rms_norm_triton(x, weight, eps, residual, kernel_config=tuning.resolve(tuning_key))


@add_rms_norm.register_fake
def _add_rms_norm_kernel_fake(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, tuning_key: str
) -> tuple[Tensor, Tensor]:
    return add_rms_norm_fake(x, residual, weight, eps)
