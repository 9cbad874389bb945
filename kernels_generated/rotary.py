"""Neox-style rotary embedding of q and k in Triton: one launch for both.

Lowers `ce::rotary` (reference: `models.ops.rotary_ref`): positions [T], q [T, Hq, D],
k [T, Hkv, D], cos_sin_cache [max_pos, rot_dim] (cos half then sin half, float32 as
models/rope.py builds it); the first rot_dim dims of each head rotate, the rest pass through.
For i < rot_dim / 2, with c, s the cos and sin of the token's position:

    out[i]        = x[i] c[i] - x[i + half] s[i]
    out[i + half] = x[i + half] c[i] + x[i] s[i]

Grid `(T, head blocks)`: a program loads its token's position and cos/sin row once and rotates
BLOCK_H heads; the head blocks of q come first, then those of k, so q and k share one launch.
q and k arrive as strided views of the QKV projection's output (split + view, never copied):
the kernel reads them through their token and head strides. The op is bound by memory
bandwidth (q and k read once and written once); BLOCK_H and num_warps per target and shape
class {HEADS = Hq + Hkv, D, T bucketed} live in configs/rotary.json, nearest key.

Rounding follows the reference (and HF): cos and sin are rounded to the activation dtype,
each product is rounded to it, then their sum; launched without FMA contraction (see the
launcher), the kernel equals the reference bit for bit: bf16 on the H200, float32 and float16
under the CPU interpreter.

Measured on the H200 (`compile-engine bench fusions`, Llama-3-8B heads, bf16, CUDA-graph
replay): 1.44 / 1.70 / 2.28 / 9.83 us at T = 1 / 64 / 256 / 2048 (4.4 TB/s at 2048), x1.8 to
x3.0 over Inductor's fusion of the reference.

On CPU the kernel runs only under the Triton interpreter (`TRITON_INTERPRET=1` set before
triton is first imported), which computes bf16 wrongly: CPU tensors must be float32 or
float16. `compile-engine bench kernel rotary [--tune]` checks, times and tunes it
(benchmarks/kernel_harness.py).
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
from compile_engine.models.ops import rotary_fake


class RotaryKernelError(RuntimeError):
    """The Triton rotary kernel cannot run these inputs here; the message says why."""


@triton.jit
def _rotate_heads(
    x_ptr,  # this token's first head
    out_ptr,
    first_head,
    num_heads,
    stride_xh,
    stride_oh,
    cos,  # [1, BLOCK_HALF] float32, already rounded to the activation dtype
    sin,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    REST: tl.constexpr,  # head_dim - rot_dim: dims that pass through
    BLOCK_REST: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    heads = first_head + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    cols = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    mask = (heads < num_heads) & (cols < HALF)
    x_row = x_ptr + heads * stride_xh
    o_row = out_ptr + heads * stride_oh
    x1 = tl.load(x_row + cols, mask=mask, other=0.0)
    x2 = tl.load(x_row + HALF + cols, mask=mask, other=0.0)
    dtype = x1.dtype
    # float32 arithmetic, rounded to the activation dtype after each product and after the
    # sum: the reference's `rot * cos + rotate_half(rot) * sin` in that dtype.
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    x1c = (a1 * cos).to(dtype).to(tl.float32)
    x2s = (a2 * sin).to(dtype).to(tl.float32)
    x2c = (a2 * cos).to(dtype).to(tl.float32)
    x1s = (a1 * sin).to(dtype).to(tl.float32)
    tl.store(o_row + cols, (x1c - x2s).to(dtype), mask=mask)
    tl.store(o_row + HALF + cols, (x2c + x1s).to(dtype), mask=mask)
    if REST > 0:
        rest = tl.arange(0, BLOCK_REST)[None, :]
        rest_mask = (heads < num_heads) & (rest < REST)
        passed = tl.load(x_row + 2 * HALF + rest, mask=rest_mask)
        tl.store(o_row + 2 * HALF + rest, passed, mask=rest_mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [T] int
    q_ptr,  # [T, Hq, D], unit last stride
    k_ptr,  # [T, Hkv, D]
    cache_ptr,  # [max_pos, rot_dim]: cos half, sin half
    q_out_ptr,
    k_out_ptr,
    num_q_heads,
    num_kv_heads,
    q_blocks,  # cdiv(Hq, BLOCK_H): program ids past it rotate k
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cache,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    REST: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    row = cache_ptr + pos * stride_cache
    cos = tl.load(row + cols, mask=cols < HALF, other=0.0)
    sin = tl.load(row + HALF + cols, mask=cols < HALF, other=0.0)
    # The reference casts the float32 table to the activation dtype before multiplying.
    act = q_ptr.dtype.element_ty
    cos = cos.to(act).to(tl.float32)
    sin = sin.to(act).to(tl.float32)
    if block < q_blocks:
        _rotate_heads(
            q_ptr + token * stride_qt,
            q_out_ptr + token * stride_qot,
            block * BLOCK_H,
            num_q_heads,
            stride_qh,
            stride_qoh,
            cos,
            sin,
            HALF,
            BLOCK_HALF,
            REST,
            BLOCK_REST,
            BLOCK_H,
        )
    else:
        _rotate_heads(
            k_ptr + token * stride_kt,
            k_out_ptr + token * stride_kot,
            (block - q_blocks) * BLOCK_H,
            num_kv_heads,
            stride_kh,
            stride_koh,
            cos,
            sin,
            HALF,
            BLOCK_HALF,
            REST,
            BLOCK_REST,
            BLOCK_H,
        )


INTERPRETED = not isinstance(_rotary_kernel, JITFunction)
"""True when triton was imported with TRITON_INTERPRET=1: the kernel then runs on CPU tensors."""


# --------------------------------------------------------------------------- configs


def shape_key(num_tokens: int, num_heads: int, head_dim: int) -> dict[str, int]:
    """Heads counts q and k together: that is what the grid spreads over."""
    return {"HEADS": num_heads, "D": head_dim, "T": bucket_tokens(num_tokens)}


@functools.cache
def config_for(
    tuning_key: str, target: str, tokens_bucket: int, num_heads: int, head_dim: int
) -> dict:
    """The launch config of a shape class in the kernel config's table (cached: looked up once
    per class, not per call)."""
    table = tuning.resolve(tuning_key).table("rotary")
    return table.lookup(target, {"HEADS": num_heads, "D": head_dim, "T": tokens_bucket})


# --------------------------------------------------------------------------- launcher


def _validate(positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise RotaryKernelError(
            f"want q [T, Hq, D] and k [T, Hkv, D], got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if positions.shape != (q.shape[0],):
        raise RotaryKernelError(f"positions {tuple(positions.shape)} != [{q.shape[0]}]")
    rot_dim = cos_sin_cache.shape[-1]
    if cos_sin_cache.dim() != 2 or rot_dim % 2 or rot_dim > q.shape[2]:
        raise RotaryKernelError(
            f"cos_sin_cache {tuple(cos_sin_cache.shape)} must be [max_pos, rot_dim] with an "
            f"even rot_dim <= head_dim {q.shape[2]}"
        )
    if q.dtype != k.dtype:
        raise RotaryKernelError(f"q is {q.dtype} and k {k.dtype}; the kernel wants one dtype")
    if q.device.type == "cpu" and not INTERPRETED:
        raise RotaryKernelError(
            "the Triton rotary kernel runs on CPU tensors only under the interpreter: set "
            "TRITON_INTERPRET=1 before triton is first imported, or leave the pass off on cpu"
        )
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        raise RotaryKernelError(
            "the Triton interpreter computes bfloat16 wrongly; use float32 or float16 on CPU"
        )


def rotary_triton(
    positions: Tensor,
    q: Tensor,
    k: Tensor,
    cos_sin_cache: Tensor,
    *,
    block_h: int | None = None,
    num_warps: int | None = None,
    kernel_config: KernelConfig | None = None,
) -> tuple[Tensor, Tensor]:
    """Same contract as `models.ops.rotary`: returns rotated (q, k), new tensors laid out as
    the op's fake promises (`empty_like`). The launch config comes from kernel_config's table
    (None: the defaults); block_h / num_warps override it."""
    _validate(positions, q, k, cos_sin_cache)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return q_out, k_out
    # The kernel wants a unit stride along head_dim; views of the QKV output have it.
    q_in = q if q.stride(-1) == 1 else q.contiguous()
    k_in = k if k.stride(-1) == 1 else k.contiguous()
    direct = q_out.stride(-1) == 1 and k_out.stride(-1) == 1
    q_dst = q_out if direct else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_dst = k_out if direct else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()

    target = TARGET_OF_DEVICE[q.device.type]
    key = (kernel_config or tuning.default()).key
    config = config_for(
        key, target, bucket_tokens(num_tokens), num_q_heads + num_kv_heads, head_dim
    )
    heads_per_program = block_h or config["BLOCK_H"]
    half = cache.shape[-1] // 2
    rest = head_dim - 2 * half
    q_blocks = triton.cdiv(num_q_heads, heads_per_program)
    grid = (num_tokens, q_blocks + triton.cdiv(num_kv_heads, heads_per_program))
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _rotary_kernel[grid](
            positions,
            q_in,
            k_in,
            cache,
            q_dst,
            k_dst,
            num_q_heads,
            num_kv_heads,
            q_blocks,
            q_in.stride(0),
            q_in.stride(1),
            k_in.stride(0),
            k_in.stride(1),
            q_dst.stride(0),
            q_dst.stride(1),
            k_dst.stride(0),
            k_dst.stride(1),
            cache.stride(0),
            HALF=half,
            BLOCK_HALF=triton.next_power_of_2(half),
            REST=rest,
            BLOCK_REST=triton.next_power_of_2(max(rest, 1)),
            BLOCK_H=heads_per_program,
            num_warps=num_warps or config["num_warps"],
            # No FMA contraction: sm_90 has bf16 multiply-add, and LLVM would fuse a product
            # with the following subtraction, skipping the rounding the reference applies in
            # between (measured on the H200: 19% of outputs one bf16 ulp off). Inductor turns
            # it off too when it emulates eager rounding (emulate_precision_casts).
            enable_fp_fusion=False,
        )
    if not direct:
        q_out.copy_(q_dst)
        k_out.copy_(k_dst)
    return q_out, k_out


# The op the rotary_triton pass swaps in for ce::rotary: its schema and the kernel config's key
# (tuning.py), opaque to Dynamo and Inductor (torch.library.triton_op fails under torch.compile
# on CPU).
@torch.library.custom_op("ce_kernels::rotary", mutates_args=())
def rotary(
    positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor, tuning_key: str
) -> tuple[Tensor, Tensor]:
    """`ce::rotary` computed by the Triton kernel."""
    return rotary_triton(positions, q, k, cos_sin_cache, kernel_config=tuning.resolve(tuning_key))


@rotary.register_fake
def _rotary_kernel_fake(
    positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor, tuning_key: str
) -> tuple[Tensor, Tensor]:
    return rotary_fake(positions, q, k, cos_sin_cache)
