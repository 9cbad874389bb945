"""GEMMs with few rows (decode-time linear layers) in Triton: y[M, N] = x[M, K] @ w[N, K]^T.

Lowers `torch.nn.functional.linear(x, w)` without bias (reference: `linear_ref`, which is
F.linear) where M is the token count of a decode step: 1 to 256 rows against a weight of
millions of elements. At small M the GEMM is a stream of the weight through the SMs, bound by
HBM bandwidth; cuBLAS's GEMV/split-K kernels on the H200 read the Llama-3-8B QKV and o_proj
weights at only 3.0-3.1 TB/s of the 4.26 TB/s copy rate, and pay a second launch for the
split-K reduction. This kernel is one launch whatever the split:

- Grid `(cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, BLOCK_M))`. A program owns BLOCK_N weight rows and
  one K-slice of K / SPLIT_K, streams its weight tile by tile (`num_stages` deep software
  pipeline) and accumulates in float32.
- MODE picks the inner product. 0: the usual `x @ w^T` on tensor cores, tile [BLOCK_M,
  BLOCK_N]. 1: the same with A and B swapped, `w @ x^T`, tile [BLOCK_N, BLOCK_M]: a tensor-core
  instruction is at least 16 (mma) or 64 (wgmma) long along its first dimension, which the
  weight's N fills and a handful of tokens does not. 2: no tensor cores, a broadcast multiply
  and a sum over K, for M <= 4 where even a 16-row tile is mostly padding.
- RAGGED (`programs_per_sm` > 0): instead of a program per BLOCK_N rows, the grid is that
  many programs per SM and program i owns rows [i N / P, (i + 1) N / P), BLOCK_N rounded up
  to hold a share. A grid of whole tiles leaves SMs idle or runs a part-empty last wave (the
  o_proj weight at BLOCK_N 64 is 64 programs on 132 SMs: perhaps what holds its stream near
  3 TB/s); an equal share for every SM does not. Measured (`bench gemm` on the H200 at
  0c6c8eb, rows 1-16) it did not pay: qkv 15.2-15.4 us against 14.8-15.7 for the best
  whole-tile config (ahead by 4% at one row only), o_proj 11.8-11.9 against 11.6-11.7, down
  and gate_up behind; no table entry uses it, `bench gemm` still sweeps it.
- TMA (`tma` in a config): the weight's [BLOCK_N, BLOCK_K] tiles come through a tensor
  descriptor, so Hopper's TMA unit copies each tile into shared memory (rows past N and columns
  past K arrive as zeros) where the pointer loads issue a load per thread. Same tiles, same
  arithmetic, bit-equal output. At one row on the H200 (`bench gemm` / `gemm-norm` at
  feefb2a, PDL chained as in a decode step): qkv with its norm 14.69 against 15.08 us, o_proj
  10.74 against 11.19, down (split 4) 29.32 against 29.51, gate_up with norm and silu 55.28
  against 55.54; in the engine (same tiles, TMA on or off, three alternating rounds) batch 1
  read 251.2-251.3 tok/s against 250.0-250.2 (`latency-tma-*-b9f6172.json`). The table names it
  for those one-row cells only.
- SPLIT_K > 1 (a runtime argument: no recompile per split): each program writes its float32
  partial tile to a workspace and counts itself in on a per-tile counter; the last of the
  tile's programs to arrive sums the partials in split order (deterministic, whoever arrives
  last) and writes the output, then resets the counter for the next call, so CUDA-graph
  replays need no memset. The counters live in one zeroed int32 buffer per device, created on
  the first call: that call must not be inside a CUDA-graph capture (the engine's warm-up runs
  first; `SkinnyGemmError` says so otherwise).

Which GEMM runs is chosen per call from configs/skinny_gemm.json, keyed by the weight's exact
(N, K) and the row count bucketed to a power of two (M <= 256), as measured on the H200 by
`compile-engine bench gemm --write-configs`: this kernel with its tuned config, cuBLASLt (torch's
preferred BLAS library switched for that call only) or cuBLAS, whichever was fastest by at
least 5% over cuBLAS. A shape without an entry, more than 256 rows, float32 or a CPU tensor
outside the interpreter run F.linear (cuBLAS). Inside a CUDA graph the choice is made once, at
capture.

Measured on the H200 (`compile-engine bench gemm`, bf16, CUDA-graph replay with the weight
read from HBM, at d813e66): the swapped dot with a [16, 64, 256] tile and no split streams the
o_proj weight [4096, 4096] in 11.2 us at M = 1..16 where cuBLAS takes 13.3-13.7 (x1.2, 3.0 TB/s)
and qkv [6144, 4096] in 14.7-15.6 us against 15.5-16.5 (x1.04-1.07, up to 3.4 TB/s); on
gate_up and down_proj, which cuBLAS already streams at 3.7-4.2 TB/s, it ties (x0.98-1.04), and
at M >= 64 it ties or loses (x0.4-1.0). The lm_head [128256, 4096] runs at 4.4-4.5 TB/s
(x1.03-1.07 at M <= 64), but it is computed outside the compiled graph, so nothing routes it
here yet. Splits helped only the K = 14336 and M = 32 cells, by a few percent.

On CPU the kernel runs only under the Triton interpreter (`TRITON_INTERPRET=1` set before
triton is first imported), float32/float16 only (the interpreter computes bf16 wrongly).
`compile-engine bench kernel skinny_gemm` checks every inner product against the reference
and times the tuned choice; `compile-engine bench gemm` sweeps its configs against cuBLAS with
the weight streamed from HBM, and writes the table (`bench kernel skinny_gemm --tune` runs it).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.configs import ConfigEntry, bucket_tokens
from compile_engine.kernels_generated.counters import arrival_counters, store_split
from compile_engine.kernels_generated.device import pdl_launch, pdl_on, sm_count
from compile_engine.kernels_generated.tuning import KernelConfig
from compile_engine.models.ops import add_rms_norm_ref, silu_and_mul_ref

log = logging.getLogger(__name__)

MAX_ROWS = 256  # above this the GEMM is compute-bound and cuBLAS's tiles are right
MAX_TILES = 1 << 16  # split-K counters per device: cdiv(N, BLOCK_N) * cdiv(M, BLOCK_M) tiles
MODES = {"dot": 0, "swap": 1, "fma": 2}
# The fused norm (add_rms_norm_gemm) re-reads x and the residual in every program: for the few
# rows of a batch-1..16 decode step, a few KB to 128 KB from L2 against the norm kernel it saves.
NORM_MAX_ROWS = 16
KERNELS = ("triton", "cublas", "cublaslt")  # what a tuned entry may run


class SkinnyGemmError(RuntimeError):
    """The skinny GEMM kernel cannot run these inputs here; the message says why."""


@triton.jit(do_not_specialize=["M", "split_k", "k_tiles"])
def _skinny_gemm_kernel(
    x_ptr,  # [M, K], unit stride along K
    w_ptr,  # [N, K], unit stride along K
    out_ptr,  # [M, N], unit stride along N
    ws_ptr,  # [split_k, M, N] float32 partials (unused when split_k == 1)
    counter_ptr,  # [>= tiles] int32, zero between calls
    M,
    N,
    K,
    k_tiles,  # BLOCK_K tiles per K-slice
    split_k,
    stride_xm,
    stride_wn,
    stride_om,
    res_ptr,  # NORM: [M, K] residual, unit stride along K (else unused)
    g_ptr,  # NORM: [K] norm weight
    sum_ptr,  # NORM: [M, K] out, x + residual (the residual stream's next value)
    stride_rm,
    stride_sm,
    eps,
    w_desc,  # TMA: a tensor descriptor of w, block [BLOCK_N, BLOCK_K] (else w again, unused)
    w_scale_ptr,  # W_SCALE: the FP8 weight's scale, [] / [N] / [cdiv(N, SBN), cdiv(K, SBK)]
    x_scale_ptr,  # X_SCALE: the FP8 activation's scale, [M] a row or []
    stride_wsn,  # W_SCALE 3: the block scales' row stride
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MODE: tl.constexpr,  # 0 dot [BM, BN], 1 swapped dot [BN, BM], 2 fma [BN, BM]
    EVEN_K: tl.constexpr,  # K == split_k * k_tiles * BLOCK_K: no K mask
    RAGGED: tl.constexpr = False,  # program i owns rows [i N / P, (i + 1) N / P), P programs
    PDL: tl.constexpr = False,  # a PDL dependent: waits for the kernel ahead, releases the next
    # after the weight loop (tuning.py)
    PREFETCH: tl.constexpr = 0,  # PDL only: this program's first PREFETCH K-tiles of w into L2
    # before it waits
    NORM: tl.constexpr = 0,  # x := rms_norm(x + residual) * g on the fly: 1 two passes, 2 one
    GATED: tl.constexpr = False,  # w is [2N, K] = [gate; up]: out = silu(x @ gate^T) * (x @ up^T)
    TMA: tl.constexpr = False,  # the weight's tiles through w_desc (the Hopper TMA unit)
    # FP8 (kernels_generated/fp8_linear.py): w is float8_e4m3fn, scaled by w_scale_ptr: 0 not
    # FP8, 1 one scale, 2 one a row (channel), 3 one a (SBN x SBK) block, applied per K-tile
    # (BLOCK_K divides SBK). X_SCALE: x is FP8 too, scaled 1 per row, 2 by one scale; 0: x is
    # half precision and the weight tile is upcast to it in registers (W8A16).
    W_SCALE: tl.constexpr = 0,
    X_SCALE: tl.constexpr = 0,
    SBN: tl.constexpr = 1,
    SBK: tl.constexpr = 1,
    LINE: tl.constexpr = 64,  # PREFETCH: weight elements a 128-byte line
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if RAGGED:
        # An equal share of the rows for each of the grid's P programs (BLOCK_N >= cdiv(N, P)):
        # a grid of whole tiles leaves SMs idle or runs a part-empty last wave.
        row_lo = (pid_n.to(tl.int64) * N // tl.num_programs(0)).to(tl.int32)
        row_hi = ((pid_n.to(tl.int64) + 1) * N // tl.num_programs(0)).to(tl.int32)
        offs_n = row_lo + tl.arange(0, BLOCK_N)
        mask_n = offs_n < row_hi
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    # A multiple of BLOCK_K by construction, which the compiler must see: with the slice start
    # of unknown alignment the loads fall back to 2-byte accesses, unpipelined (measured on
    # the H200: 2-3 TB/s at M = 1, 0.5 TB/s at M = 256).
    k_start = pid_k * k_tiles * BLOCK_K
    mask_m = offs_m < M
    if PREFETCH != 0:
        # The weight does not depend on the kernel before (attention, for o_proj): stream this
        # program's first tiles into L2 while that kernel finishes, then wait for its output.
        # One prefetch a 128-byte line (64 half-precision elements); rows past N re-fetch row 0.
        rows = tl.where(mask_n, offs_n, 0).to(tl.int64) * stride_wn
        lines = k_start + tl.arange(0, BLOCK_K // LINE) * LINE
        prefetched = tl.minimum(k_tiles, PREFETCH)
        for k in range(0, prefetched * BLOCK_K, BLOCK_K):
            tl.inline_asm_elementwise(
                "prefetch.global.L2 [$1]; mov.u32 $0, 0;",
                "=r,l",
                [w_ptr + rows[:, None] + (k + lines)[None, :]],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
    if PDL:
        tl.extra.cuda.gdc_wait()
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_start + offs_k)[None, :]
    if NORM > 0:
        r_ptrs = res_ptr + offs_m[:, None].to(tl.int64) * stride_rm + (k_start + offs_k)[None, :]
        g_ptrs = g_ptr + k_start + offs_k
    if NORM == 2:
        # The squares element by element, in registers, reduced once after the weight loop:
        # a row sum every K-tile is a cross-warp reduction (shuffles, shared memory and a
        # barrier) inside the loop that streams the weight. In an offline sm_90 compile of the
        # batch-1 qkv launch the loop lost 80 shuffles and 3 of its 5 barriers a K-tile; in the
        # engine (H200, batch 1, 908d9f3) 248.1 / 248.1 against 245.9 / 245.9 tok/s.
        square_tiles = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    if NORM == 1:
        # Two passes (a split K-slice needs the whole row's mean of squares first): every
        # program reads its rows of x and the residual once more (at most NORM_MAX_ROWS rows
        # of K elements, from L2), then normalises each tile as HF rounds it. The sum is
        # rounded to the activation dtype first, as the residual stream it becomes is.
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        for kk in range(0, K, BLOCK_K):
            in_row = mask_m[:, None] & ((kk + offs_k) < K)[None, :]
            xo = offs_m[:, None].to(tl.int64) * stride_xm + (kk + offs_k)[None, :]
            ro = offs_m[:, None].to(tl.int64) * stride_rm + (kk + offs_k)[None, :]
            xs = tl.load(x_ptr + xo, mask=in_row, other=0.0)
            rs = tl.load(res_ptr + ro, mask=in_row, other=0.0)
            row = (xs.to(tl.float32) + rs.to(tl.float32)).to(xs.dtype).to(tl.float32)
            squares += tl.sum(row * row, axis=1)
        rstd = tl.rsqrt(squares / K + eps)
    if MODE == 0:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if GATED:
        # The up rows of these output columns, N rows below their gate rows: one program owns
        # both halves of its columns, so silu_and_mul becomes its epilogue.
        u_ptrs = w_ptrs + N.to(tl.int64) * stride_wn
        acc_up = tl.zeros_like(acc)
    for k in range(0, k_tiles * BLOCK_K, BLOCK_K):
        if TMA:
            # Rows past N and columns past K arrive as zeros (the descriptor's bounds).
            w = w_desc.load([pid_n * BLOCK_N, k_start + k])
        elif EVEN_K:
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
        else:
            in_k = (k_start + k + offs_k) < K
            w = tl.load(w_ptrs, mask=mask_n[:, None] & in_k[None, :], other=0.0)
        if EVEN_K:
            x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
        else:
            in_k = (k_start + k + offs_k) < K
            x = tl.load(x_ptrs, mask=mask_m[:, None] & in_k[None, :], other=0.0)
        if W_SCALE > 0 and X_SCALE == 0 and MODE != 2:
            # W8A16: e4m3 is exact in bf16/fp16, so the upcast tile is the stored weight.
            w = w.to(x.dtype)
        if NORM > 0:
            # float32 arithmetic rounded where the reference rounds: a half-precision op on
            # the GPU is that anyway, and the interpreter computes bf16 wrongly.
            if EVEN_K:
                g = tl.load(g_ptrs)
                rs = tl.load(r_ptrs, mask=mask_m[:, None], other=0.0)
            else:
                in_k = (k_start + k + offs_k) < K
                g = tl.load(g_ptrs, mask=in_k, other=0.0)
                rs = tl.load(r_ptrs, mask=mask_m[:, None] & in_k[None, :], other=0.0)
            row = (x.to(tl.float32) + rs.to(tl.float32)).to(x.dtype)
            if NORM == 1:
                # HF's rounding: normalised in float32 and rounded back, then scaled by the
                # weight in the activation dtype.
                normed = (row.to(tl.float32) * rstd[:, None]).to(x.dtype)
                x = (g[None, :].to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
            else:
                # One pass (the K-slice is the whole row): the mean of squares accumulates
                # beside the dot product of the unnormalised g * (x + r), and 1 / rms scales
                # the rows at the end. No second read of x and the residual ahead of the
                # weight stream; the normalised row is not rounded before the weight scales
                # it, so the result differs from HF's by that rounding, not more.
                square_tiles += row.to(tl.float32) * row.to(tl.float32)
                x = (g[None, :].to(tl.float32) * row.to(tl.float32)).to(x.dtype)
            r_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
        if W_SCALE == 3:
            # This K-tile's block scale of each weight row (BLOCK_K divides SBK): the tile's
            # products are scaled before they join the sum.
            s_ptrs = w_scale_ptr + (offs_n // SBN) * stride_wsn + (k_start + k) // SBK
            s_blk = tl.load(s_ptrs, mask=mask_n, other=0.0)
            if MODE == 0:
                acc += tl.dot(x, tl.trans(w)) * s_blk[None, :]
            elif MODE == 1:
                acc += tl.dot(w, tl.trans(x)) * s_blk[:, None]
            else:
                prod = w[:, None, :].to(tl.float32) * x[None, :, :].to(tl.float32)
                acc += tl.sum(prod, axis=2) * s_blk[:, None]
        elif MODE == 0:
            acc = tl.dot(x, tl.trans(w), acc)
        elif MODE == 1:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc += tl.sum(w[:, None, :].to(tl.float32) * x[None, :, :].to(tl.float32), axis=2)
        if GATED:
            if TMA:
                # Gate rows past N read the first up rows: their columns are not stored.
                u = w_desc.load([N + pid_n * BLOCK_N, k_start + k])
            elif EVEN_K:
                u = tl.load(u_ptrs, mask=mask_n[:, None], other=0.0)
            else:
                in_k = (k_start + k + offs_k) < K
                u = tl.load(u_ptrs, mask=mask_n[:, None] & in_k[None, :], other=0.0)
            if MODE == 0:
                acc_up = tl.dot(x, tl.trans(u), acc_up)
            elif MODE == 1:
                acc_up = tl.dot(u, tl.trans(x), acc_up)
            else:
                acc_up += tl.sum(
                    u[:, None, :].to(tl.float32) * x[None, :, :].to(tl.float32), axis=2
                )
            u_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if NORM > 0 and pid_k == 0:
        # The residual sum, K-tile t by the t-th program of these rows, after the weight
        # loop, which so holds only the loads the pipeline streams and the dot product.
        for t in range(pid_n, tl.cdiv(K, BLOCK_K), tl.num_programs(0)):
            cols = t * BLOCK_K + offs_k
            in_row = mask_m[:, None] & (cols < K)[None, :]
            xs = tl.load(
                x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + cols[None, :],
                mask=in_row,
                other=0.0,
            )
            rs = tl.load(
                res_ptr + offs_m[:, None].to(tl.int64) * stride_rm + cols[None, :],
                mask=in_row,
                other=0.0,
            )
            tl.store(
                sum_ptr + offs_m[:, None].to(tl.int64) * stride_sm + cols[None, :],
                (xs.to(tl.float32) + rs.to(tl.float32)).to(xs.dtype),
                mask=in_row,
            )
    if NORM == 2:
        squares = tl.sum(square_tiles, axis=1)
        rstd = tl.rsqrt(squares / K + eps)
        if MODE == 0:
            acc = acc * rstd[:, None]
            if GATED:
                acc_up = acc_up * rstd[:, None]
        else:
            acc = acc * rstd[None, :]
            if GATED:
                acc_up = acc_up * rstd[None, :]
    # The FP8 scales in the epilogue: linear, so each split-K partial takes them as the sum.
    if W_SCALE == 1:
        acc = acc * tl.load(w_scale_ptr)
    if W_SCALE == 2:
        s_row = tl.load(w_scale_ptr + offs_n, mask=mask_n, other=0.0)
        if MODE == 0:  # noqa: SIM108 (a statement per layout reads as the loop's do)
            acc = acc * s_row[None, :]
        else:
            acc = acc * s_row[:, None]
    if X_SCALE == 1:
        s_tok = tl.load(x_scale_ptr + offs_m, mask=mask_m, other=0.0)
        if MODE == 0:  # noqa: SIM108
            acc = acc * s_tok[:, None]
        else:
            acc = acc * s_tok[None, :]
    if X_SCALE == 2:
        acc = acc * tl.load(x_scale_ptr)
    if GATED:
        # silu_and_mul as its reference rounds: the GEMM's outputs in the activation dtype,
        # F.silu rounded, the product rounded at the store.
        out_ty = out_ptr.dtype.element_ty
        gate = acc.to(out_ty).to(tl.float32)
        activated = (gate / (1.0 + tl.exp(-gate))).to(out_ty)
        acc = activated.to(tl.float32) * acc_up.to(out_ty).to(tl.float32)

    # Output and workspace offsets in the accumulator's own layout.
    if MODE == 0:
        o_offs = offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        p_offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        o_mask = mask_m[:, None] & mask_n[None, :]
    else:
        o_offs = offs_n[:, None] + offs_m[None, :].to(tl.int64) * stride_om
        p_offs = offs_n[:, None] + offs_m[None, :].to(tl.int64) * N
        o_mask = mask_n[:, None] & mask_m[None, :]
    tile = pid_m * tl.num_programs(0) + pid_n
    store_split(acc, o_offs, p_offs, o_mask, out_ptr, ws_ptr, counter_ptr, M.to(tl.int64) * N,
                split_k, pid_k, tile)  # fmt: skip


INTERPRETED = not isinstance(_skinny_gemm_kernel, JITFunction)
"""True when triton was imported with TRITON_INTERPRET=1: the kernel then runs on CPU tensors."""


# --------------------------------------------------------------------------- launcher


def _counters(device: torch.device) -> Tensor:
    """The split-K arrival counters, one per output tile (kernels_generated/counters.py)."""
    return arrival_counters("skinny_gemm", device, MAX_TILES, SkinnyGemmError)


def _validate(x: Tensor, w: Tensor, fp8: bool = False) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise SkinnyGemmError(f"want x [M, K] and w [N, K], got {tuple(x.shape)}, {tuple(w.shape)}")
    if fp8:
        if w.dtype != torch.float8_e4m3fn:
            raise SkinnyGemmError(f"an FP8 launch takes a float8_e4m3fn weight, not {w.dtype}")
        if x.device.type == "cpu":
            raise SkinnyGemmError(
                "the FP8 skinny GEMM runs on CUDA only: the Triton interpreter cannot cast FP8"
            )
        return
    if x.dtype != w.dtype:
        raise SkinnyGemmError(f"x is {x.dtype} and w {w.dtype}; the kernel wants one dtype")
    if x.device.type == "cpu" and not INTERPRETED:
        raise SkinnyGemmError(
            "the Triton skinny GEMM runs on CPU tensors only under the interpreter: set "
            "TRITON_INTERPRET=1 before triton is first imported, or leave the pass off on cpu"
        )
    if x.device.type == "cpu" and x.dtype == torch.bfloat16:
        raise SkinnyGemmError(
            "the Triton interpreter computes bfloat16 wrongly; use float32 or float16 on CPU"
        )


def prefetch_tiles(kernel_config: KernelConfig, w: Tensor, block_k: int, even_k: bool) -> int:
    """The PREFETCH constexpr of a PDL launch: the config's `pdl_prefetch_tiles` leading
    K-tiles of the weight slice, where the prefetch can cover whole BLOCK_K tiles of
    half-precision or FP8 rows (EVEN_K launches; one prefetch a 128-byte line); else 0."""
    line = 128 // w.element_size()
    if even_k and block_k % line == 0 and w.element_size() in (1, 2):
        return kernel_config.pdl_prefetch_tiles
    return 0


@dataclass(frozen=True, slots=True)
class Fp8Operands:
    """What an FP8 launch adds (kernels_generated/fp8_linear.py): the weight's scale and its
    kind ("tensor", "channel", "block" with `block` (n, k)), the activation's scale when x is
    FP8 too ([M] one a row, or [] one for all; None: x is half precision, W8A16), and the
    output dtype."""

    w_scale: Tensor
    kind: str
    out_dtype: torch.dtype
    x_scale: Tensor | None = None
    block: tuple[int, int] | None = None

    @property
    def w_mode(self) -> int:
        return {"tensor": 1, "channel": 2, "block": 3}[self.kind]

    @property
    def x_mode(self) -> int:
        if self.x_scale is None:
            return 0
        return 2 if self.x_scale.numel() == 1 else 1


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """One launch's choices, what a tuned table entry of kernel "triton" holds.
    programs_per_sm > 0: the rows are shared out evenly among that many programs per SM
    (RAGGED), block_n rounded up to hold a share, instead of a program per block_n rows.
    tma: the weight's [block_n, block_k] tiles come through a tensor descriptor (Hopper's TMA
    unit) instead of pointer loads; whole tiles only (no programs_per_sm)."""

    mode: str = "swap"
    block_m: int = 16
    block_n: int = 32
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    programs_per_sm: int = 0
    tma: bool = False


def skinny_gemm(
    x: Tensor, w: Tensor, *, kernel_config: KernelConfig | None = None, **config
) -> Tensor:
    """x [M, K] @ w [N, K]^T with one explicit launch config (LaunchConfig's fields; the tuned
    choice is `linear`'s); kernel_config's PDL settings (None: the defaults)."""
    _validate(x, w)
    return _launch(x, w, None, LaunchConfig(**config), kernel_config or tuning.default())[0]


def add_rms_norm_gemm(
    x: Tensor,
    residual: Tensor,
    norm_weight: Tensor,
    eps: float,
    w: Tensor,
    *,
    gated: bool = False,
    kernel_config: KernelConfig | None = None,
    **config,
) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual) @ w^T, x + residual) in one launch, configs as `skinny_gemm`'s:
    the first programs write the residual sum, a K-tile each, after their weight loop.
    Unsplit (split_k 1), a program's loop accumulates the norm's mean of squares beside the
    dot product of the unnormalised g * (x + residual) and scales by 1 / rms at the end: one
    pass over x, but the normalised row is not rounded to the activation dtype before the
    weight scales it, as HF rounds it. Split, every program first reads its rows whole for the
    mean of squares, then normalises each tile as HF does. At most NORM_MAX_ROWS rows either
    way: every program reads all of its rows of x and the residual. gated: w is [gate; up]
    (2I rows) and the output silu_and_mul of the product, [M, I], each program taking block_n
    columns of both halves; no split-K (the epilogue needs whole sums) and no ragged rows."""
    if residual.shape != x.shape or residual.dtype != x.dtype or norm_weight.dtype != x.dtype:
        raise SkinnyGemmError(
            f"residual {tuple(residual.shape)} {residual.dtype} and norm weight "
            f"{norm_weight.dtype} must match x {tuple(x.shape)} {x.dtype}"
        )
    if norm_weight.shape != (x.shape[1],):
        raise SkinnyGemmError(f"norm weight {tuple(norm_weight.shape)}, want ({x.shape[1]},)")
    if x.shape[0] > NORM_MAX_ROWS:
        raise SkinnyGemmError(f"{x.shape[0]} rows: the fused norm takes at most {NORM_MAX_ROWS}")
    launch = LaunchConfig(**config)
    if gated and (w.shape[0] % 2 or launch.split_k != 1 or launch.programs_per_sm):
        raise SkinnyGemmError(
            f"a gated launch needs an even weight row count (got {w.shape[0]}), split_k 1 and "
            f"whole tiles (got split_k {launch.split_k}, programs_per_sm "
            f"{launch.programs_per_sm})"
        )
    _validate(x, w)
    kernel_config = kernel_config or tuning.default()
    return _launch(x, w, (residual, norm_weight, eps), launch, kernel_config, gated)


def _weight_descriptor(w: Tensor, block_n: int, block_k: int) -> TensorDescriptor:
    """w's TMA descriptor, tiles [block_n, block_k]: its start and row stride 16-byte aligned
    (a tuned table names TMA only for the model shapes it swept, which are)."""
    row_bytes = w.stride(0) * w.element_size()
    if w.data_ptr() % 16 or row_bytes % 16:
        raise SkinnyGemmError(
            f"a TMA launch needs a 16-byte aligned weight and row stride (row {row_bytes} "
            f"bytes, address {w.data_ptr():#x}); run this weight with tma off"
        )
    return TensorDescriptor.from_tensor(w, [block_n, block_k])


def _launch(
    x: Tensor,
    w: Tensor,
    norm: tuple[Tensor, Tensor, float] | None,
    config: LaunchConfig,
    kernel_config: KernelConfig,
    gated: bool = False,
    fp8: Fp8Operands | None = None,
) -> tuple[Tensor, Tensor | None]:
    mode, block_m, block_n, block_k = config.mode, config.block_m, config.block_n, config.block_k
    split_k, programs_per_sm = config.split_k, config.programs_per_sm
    num_rows, k_size = x.shape
    n_size = w.shape[0] // 2 if gated else w.shape[0]  # output columns
    out_dtype = fp8.out_dtype if fp8 is not None else x.dtype
    out = torch.empty(num_rows, n_size, dtype=out_dtype, device=x.device)
    summed = torch.empty_like(x) if norm is not None else None
    if num_rows == 0:
        return out, summed
    if mode == "fma":
        block_m = triton.next_power_of_2(num_rows) if num_rows < block_m else block_m
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    residual, norm_weight, eps = norm if norm is not None else (x, x, 0.0)
    if residual.stride(-1) != 1:
        residual = residual.contiguous()
    norm_weight = norm_weight.contiguous()
    split_k = max(1, min(split_k, triton.cdiv(k_size, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k_size, split_k), block_k) * block_k
    split_k = triton.cdiv(k_size, k_per_split)  # no empty trailing slices
    if config.tma and programs_per_sm > 0:
        raise SkinnyGemmError("a TMA launch takes whole tiles: programs_per_sm must be 0")
    if programs_per_sm > 0:
        row_programs = min(programs_per_sm * sm_count(x.device), n_size)
        block_n = max(block_n, triton.next_power_of_2(triton.cdiv(n_size, row_programs)))
    else:
        row_programs = triton.cdiv(n_size, block_n)
    grid = (row_programs, split_k, triton.cdiv(num_rows, block_m))
    even_k = k_per_split * split_k == k_size
    pdl = pdl_on(kernel_config, x.device, num_rows)
    counters = _counters(x.device)
    if split_k > 1:
        if grid[0] * grid[2] > MAX_TILES:
            raise SkinnyGemmError(f"{grid[0] * grid[2]} tiles exceed the {MAX_TILES} counters")
        workspace = torch.empty(split_k, num_rows, n_size, dtype=torch.float32, device=x.device)
    else:
        workspace = out
    sum_out = summed if summed is not None else x
    w_desc = _weight_descriptor(w, block_n, block_k) if config.tma else w
    if fp8 is not None:
        w_scale, stride_wsn = fp8.w_scale, fp8.w_scale.stride(0) if fp8.w_scale.dim() == 2 else 0
        x_scale = fp8.x_scale if fp8.x_scale is not None else fp8.w_scale
        scale_block = fp8.block or (1, 1)
        if fp8.kind == "block" and scale_block[1] % block_k:
            # Every K-tile starts at a multiple of block_k, so it then lies in one scale block.
            raise SkinnyGemmError(
                f"block scales of {scale_block[1]} columns need a block_k that divides them "
                f"(got {block_k})"
            )
    else:
        w_scale = x_scale = out
        stride_wsn, scale_block = 0, (1, 1)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _skinny_gemm_kernel[grid](
            x,
            w,
            out,
            workspace,
            counters,
            num_rows,
            n_size,
            k_size,
            k_per_split // block_k,
            split_k,
            x.stride(0),
            w.stride(0),
            out.stride(0),
            residual,
            norm_weight,
            sum_out,
            residual.stride(0),
            sum_out.stride(0),
            eps,
            w_desc,
            w_scale,
            x_scale,
            stride_wsn,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            MODE=MODES[mode],
            EVEN_K=even_k,
            RAGGED=programs_per_sm > 0,
            PDL=pdl,
            PREFETCH=prefetch_tiles(kernel_config, w, block_k, even_k) if pdl else 0,
            NORM=0 if norm is None else (2 if split_k == 1 else 1),
            GATED=gated,
            TMA=config.tma,
            W_SCALE=fp8.w_mode if fp8 is not None else 0,
            X_SCALE=fp8.x_mode if fp8 is not None else 0,
            SBN=scale_block[0],
            SBK=scale_block[1],
            LINE=128 // w.element_size(),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            **pdl_launch(pdl),
        )
    return out, summed


# --------------------------------------------------------------------------- tuned choice


@functools.cache
def _entry(
    tuning_key: str, target: str, n_size: int, k_size: int, rows_bucket: int
) -> ConfigEntry | None:
    """The entry of the kernel config's skinny_gemm table tuned for this weight and row
    bucket: only entries of exactly this (N, K) count (a config tuned for another weight says
    nothing about whether cuBLAS loses here), the nearest M bucket among them."""
    section = tuning.resolve(tuning_key).table("skinny_gemm").targets.get(target)
    entries = [
        e
        for e in (section.entries if section else [])
        if e.key["N"] == n_size and e.key["K"] == k_size
    ]
    if not entries:
        return None
    return min(entries, key=lambda e: abs(e.key["M"].bit_length() - rows_bucket.bit_length()))


@functools.cache
def config_for(
    tuning_key: str, target: str, n_size: int, k_size: int, rows_bucket: int
) -> tuple[str, dict]:
    """(kernel, launch config) tuned for this weight and row bucket (`_entry`): kernel "triton"
    with the skinny_gemm arguments, or "cublas" / "cublaslt" with none; no entry means cuBLAS."""
    entry = _entry(tuning_key, target, n_size, k_size, rows_bucket)
    if entry is None:
        return "cublas", {}
    config = dict(entry.config)
    kernel = config.pop("kernel")
    if kernel not in KERNELS:
        table = tuning.resolve(tuning_key).table_path("skinny_gemm")
        raise SkinnyGemmError(f"{table}: unknown kernel {kernel!r}; one of {KERNELS}")
    return kernel, config


def linear_ref(x: Tensor, w: Tensor) -> Tensor:
    return F.linear(x, w)


def reads_table(x: Tensor) -> bool:
    """Whether x's device and dtype may run the Triton kernel, so the h100 table decides: CUDA
    half precision; under the interpreter, CPU tensors in float32/float16, so that tests on
    CPU run the kernel the GPU would."""
    if x.device.type == "cuda" and not INTERPRETED:
        return x.dtype in (torch.bfloat16, torch.float16)
    return INTERPRETED and x.device.type == "cpu" and x.dtype != torch.bfloat16


def choose(kernel_config: KernelConfig, x: Tensor, w: Tensor) -> tuple[str, dict]:
    """The (kernel, config) `linear` runs x @ w^T with: the table's (`config_for`) for up to
    MAX_ROWS rows where it `reads_table`, else cuBLAS."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 0 < rows <= MAX_ROWS or not reads_table(x):
        return "cublas", {}
    return config_for(kernel_config.key, "h100", w.shape[0], w.shape[1], bucket_tokens(rows))


@contextlib.contextmanager
def blas_library(name: str):
    """torch's preferred BLAS library set to `name` for the calls inside, then restored. A
    process-wide flag that cuBLAS GEMMs read at dispatch: inside a CUDA-graph capture the
    library is fixed into the graph."""
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def tuned_linear(kernel_config: KernelConfig, x: Tensor, w: Tensor) -> Tensor:
    """F.linear(x, w) by what won the tuning sweep for this weight and row count in the
    kernel config's table: the Triton skinny GEMM, cuBLASLt, or cuBLAS (also where nothing
    was tuned)."""
    kernel, config = choose(kernel_config, x, w)
    if kernel == "triton":
        flat = x.reshape(-1, x.shape[-1])
        out = skinny_gemm(flat, w, kernel_config=kernel_config, **config)
        return out.view(*x.shape[:-1], w.shape[0])
    if kernel == "cublaslt" and x.is_cuda:
        with blas_library("cublaslt"):
            return F.linear(x, w)
    return F.linear(x, w)


# The op the skinny_gemm pass swaps in for a bias-free F.linear: opaque to Dynamo and Inductor
# (Inductor would otherwise lower the mm to cuBLAS again), one call in the CUDA graph. `tuning`
# is the key of the engine's KernelConfig (tuning.py).
@torch.library.custom_op("ce_kernels::skinny_linear", mutates_args=())
def linear(x: Tensor, w: Tensor, tuning_key: str) -> Tensor:
    """`tuned_linear` with the kernel config whose key the pass gave."""
    return tuned_linear(tuning.resolve(tuning_key), x, w)


@linear.register_fake
def _linear_fake(x: Tensor, w: Tensor, tuning_key: str) -> Tensor:
    return x.new_empty(*x.shape[:-1], w.shape[0])


def fused_config(kernel_config: KernelConfig, x: Tensor, w: Tensor, gated: bool) -> dict | None:
    """The launch config `add_rms_norm_linear` runs fused with, or None for the unfused path:
    the entry's `fused` config for this launch kind ("gated" with silu_and_mul, else "plain"),
    which `compile-engine bench gemm-norm --write-configs` writes only where the fused launch
    beat the norm kernel and the tuned GEMM [and silu_and_mul] it replaces; at most
    NORM_MAX_ROWS rows, on inputs that `reads_table`."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 0 < rows <= NORM_MAX_ROWS or not reads_table(x):
        return None
    entry = _entry(kernel_config.key, "h100", w.shape[0], w.shape[1], bucket_tokens(rows))
    fused = (entry.info.get("fused", {}) if entry else {}).get("gated" if gated else "plain")
    return dict(fused["config"]) if fused else None


def _activation(kernel_config: KernelConfig, gate_up: Tensor) -> Tensor:
    """silu_and_mul of a [.., 2I] GEMM output: the Triton kernel on CUDA, else the reference."""
    if gate_up.is_cuda and not INTERPRETED:
        from compile_engine.kernels_generated.silu_and_mul import silu_and_mul_triton

        return silu_and_mul_triton(gate_up, kernel_config=kernel_config)
    return silu_and_mul_ref(gate_up)


# The op the add_rms_norm_into_gemm pass swaps in for add_rms_norm feeding a bias-free linear,
# and with gated the silu_and_mul after it too: (linear(rms_norm(x + residual)) [silu_and_mul],
# x + residual).
@torch.library.custom_op("ce_kernels::add_rms_norm_linear", mutates_args=())
def add_rms_norm_linear(
    x: Tensor,
    residual: Tensor,
    norm_weight: Tensor,
    eps: float,
    w: Tensor,
    gated: bool,
    tuning_key: str,
) -> tuple[Tensor, Tensor]:
    """Where `fused_config` gives a config: one launch of the skinny GEMM with the norm (and
    the activation) fused. Otherwise the norm as `ce::add_rms_norm` computes it (the Triton
    norm kernel on CUDA, the reference elsewhere), `tuned_linear`, and silu_and_mul if gated."""
    kernel_config = tuning.resolve(tuning_key)
    config = fused_config(kernel_config, x, w, gated)
    out_features = w.shape[0] // 2 if gated else w.shape[0]
    if config is not None:
        flat = x.reshape(-1, x.shape[-1])
        out, summed = add_rms_norm_gemm(
            flat, residual.reshape(flat.shape), norm_weight, eps, w, gated=gated,
            kernel_config=kernel_config, **config,
        )  # fmt: skip
        return out.view(*x.shape[:-1], out_features), summed.view(x.shape)
    if x.is_cuda and not INTERPRETED:
        from compile_engine.kernels_generated.add_rms_norm import rms_norm_triton

        normed, summed = rms_norm_triton(x, norm_weight, eps, residual, kernel_config=kernel_config)
    else:
        normed, summed = add_rms_norm_ref(x, residual, norm_weight, eps)
    out = tuned_linear(kernel_config, normed, w)
    return (_activation(kernel_config, out) if gated else out), summed


@add_rms_norm_linear.register_fake
def _add_rms_norm_linear_fake(
    x: Tensor,
    residual: Tensor,
    norm_weight: Tensor,
    eps: float,
    w: Tensor,
    gated: bool,
    tuning_key: str,
) -> tuple[Tensor, Tensor]:
    out_features = w.shape[0] // 2 if gated else w.shape[0]
    return x.new_empty(*x.shape[:-1], out_features), torch.empty_like(x)


def add_rms_norm_linear_ref(
    x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, w: Tensor, gated: bool = False
) -> tuple[Tensor, Tensor]:
    normed, summed = add_rms_norm_ref(x, residual, norm_weight, eps)
    out = linear_ref(normed, w)
    return (silu_and_mul_ref(out) if gated else out), summed
