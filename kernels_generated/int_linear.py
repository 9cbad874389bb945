"""Integer weight-only linears on the GPU (issue 29): what the quantized_gemm pass lowers an
int4 / int8 `ce.quant_linear` to on h100. y[M, N] = x[M, K] @ dequant(w)[N, K]^T.

One Triton kernel, dequantizing in registers, for every row count:

- The weight in its "plain" layout (models/quant.py), which the loader repacks GPTQ / AWQ /
  compressed-tensors checkpoints into (the artifact's quantization record names both, the
  checkpoint's `packing` and the scheme's layout): 4-bit codes two a byte [N, K / 2], even k in
  the low nibble; 8-bit codes one a byte [N, K]; group scales float32 [N, G], or [N, G, 2] =
  (s, z) for the zero-point formats (uint4_zp / uint8_zp), with G = K / group.
- A program owns BLOCK_N weight rows, BLOCK_M activation rows and one K-slice (split-K), and
  walks it in BLOCK_K tiles that lie inside one group each (BLOCK_K divides the group). Per
  tile it loads the codes, subtracts the zero point (8 for int4, 0 for int8, the group's z for
  the _zp formats): small whole numbers, exact in bf16 / fp16, multiplies them with the
  activation tile, accumulating in float32, and scales the tile's [BLOCK_M, BLOCK_N] sum by the
  group's scale. So the dequantization is exact and the product differs from the reference
  (`quant_linear_ref`: dequantize in float32, matmul) by the order of accumulation only: the
  scale multiplies a tile's sum rather than each term.
- FMA (one row, `_int_fma_kernel`, a program per row): no tensor cores (a 16-row tile
  would be mostly padding). Lanes run over weight rows: a thread holds a row's int32 words
  (16-byte loads) and the activations of their columns, one contiguous load a tile that every
  lane shares, shifts each code position out and ORs it into float32's mantissa under 2^23
  (one LOP3, no integer-to-float conversion, which Hopper issues at an eighth of the FMA
  rate) and accumulates the products itself; the only reduction across threads is after the
  K loop. (The first form reduced across threads every tile; a second, lanes along K, loaded
  each code position's activations strided over many cache lines: both lost to the dot.)
  Otherwise `tl.dot` on tensor cores:
  at most 16 rows the "skinny" config, above 16 the "tiles" config (64 x 128 tiles): a
  tensor-core GEMM that dequantizes each weight tile in registers on its way to the MMA.
- 4-bit tiles, dequant "convert": a byte per two codes, the activation's even and odd columns
  loaded apart, so the low and high nibbles meet their own columns with no interleave in
  registers: two dots of BLOCK_K / 2 each, the codes through integer-to-float conversions.
  Dequant "bits" (dot tiles, bf16 / fp16 activations): each code OR-ed into the mantissa of a
  16-bit float 2^E (bf16 128.0, fp16 1024.0) reads as 2^E + c, and subtracting 2^E + zero is
  exact, so no conversion instruction runs (Hopper issues those at an eighth of the FMA rate);
  the nibbles join into one [BLOCK_N, BLOCK_K] tile whose columns are in order, and one dot
  takes the contiguous activation tile. Which is faster is the table's to say, per shape.
- SPLIT_K > 1: as the bf16 skinny GEMM (kernels_generated/skinny_gemm.py), each program stores
  its float32 partial and counts itself in on the output tile's counter; the last to arrive
  sums the partials in split order (deterministic) and resets the counter, so CUDA-graph
  replays need no memset. The split is chosen per call to give `programs_per_sm` programs per
  SM (a decode GEMV of few tiles would otherwise leave SMs idle), capped by the K-tiles.

Launch configs come from configs/int_gemm.json (`KernelConfig.table("int_gemm")`): defaults
"fma" (rows <= FMA_MAX_ROWS), "skinny" (<= SKINNY_MAX_ROWS) and "tiles" (above), and tuned
entries keyed by the weight's (N, K) and the row bucket, nearest M, written by `bench int-gemm
--write-configs` (benchmarks/int_gemm.py). bias is added after the kernel.

Measured on the H200 (`bench int-gemm`, Llama-3-8B decoder linears, int4 in groups of 128): at
417898e the tuned "convert" dot tiles ran 1.0-1.6x slower than bf16 cuBLAS (dequantization,
not memory, bound them; GPTQ int4 decoded 175.8 tok/s at batch 1, 3,063 at 64). At d8309d5
"bits" with the weight as the left operand (swap) won 11 of the 12 cells: 1 row 0.7-1.0x
cuBLAS's time (gate_up 40.9 us against 56.5), 64 rows 1.0-2.0x (down 35.6 us against 36.4);
GPTQ int4 decodes 282.3 tok/s at batch 1 and 11,079 at 64. On CPU the kernel runs under the
Triton interpreter only (TRITON_INTERPRET=1; float32 / float16 activations, the interpreter
computes bf16 wrongly), as tests/kernels/test_int_linear.py does in tiny shapes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.configs import bucket_tokens
from compile_engine.kernels_generated.counters import arrival_counters, store_split
from compile_engine.kernels_generated.device import sm_count
from compile_engine.kernels_generated.tuning import KernelConfig
from compile_engine.models.quant import QuantScheme

FMA_MAX_ROWS = 1  # the fma form runs a program per row: one row, one read of the weight
SKINNY_MAX_ROWS = 16
MAX_TILES = 1 << 16  # split-K counters per device
# The weight formats this kernel runs (the GGUF (s, m) formats uint4 / uint8 run the
# reference on CUDA; the loader dequantizes GGUF files there anyway).
KERNEL_WEIGHTS = ("int4", "int8", "uint4_zp", "uint8_zp")


class IntLinearError(RuntimeError):
    """The integer linear kernel cannot run these inputs here; the message says why."""


@dataclass(frozen=True, slots=True)
class IntLaunch:
    """One launch config of the kernel (a table entry's or default's fields)."""

    mode: str  # "fma" or "dot"
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    programs_per_sm: int = 0  # split K until the grid has this many programs per SM (0: none)
    # 4-bit dot tiles: "convert" (integer to float conversions, two dots over the even and odd
    # columns) or "bits" (each code OR-ed into a 16-bit float's mantissa, the nibbles joined
    # into one tile, one dot); module docstring.
    dequant: str = "convert"
    # dot tiles: the weight tile as the dot's left operand and the activations as its right
    # (out^T = w @ x^T). Hopper's wgmma reads its left operand from registers and only its
    # right from shared memory, so the tile dequantized in registers feeds the MMA directly.
    swap: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("fma", "dot"):
            raise IntLinearError(f"mode {self.mode!r}: 'fma' or 'dot'")
        if self.dequant not in ("convert", "bits"):
            raise IntLinearError(f"dequant {self.dequant!r}: 'convert' or 'bits'")
        if self.mode == "fma" and self.block_m != 1:
            raise IntLinearError(f"block_m={self.block_m}: the fma form runs one row a program")
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise IntLinearError(f"{name}={value}: a power of two")


@triton.jit
def _mma(x, w, SWAP: tl.constexpr):
    """One tile's product, float32: x [BM, BK] @ w [BN, BK]^T, or its transpose [BN, BM] with
    the weight as the left operand (SWAP)."""
    if SWAP:  # noqa: SIM108 (a constexpr branch: one dot is traced, of one shape)
        out = tl.dot(w, tl.trans(x))
    else:
        out = tl.dot(x, tl.trans(w))
    return out


@triton.jit
def _finish(acc, offs_m, offs_n, M, N, out_ptr, ws_ptr, counter_ptr, stride_om, split_k):
    """Store a program's [BM, BN] sum, or with split-K its float32 partial, and the last of the
    output tile's programs to arrive sums the partials in split order. Programs are laid out
    (N tile, K slice, M tile)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    mask_m = offs_m < M
    mask_n = offs_n < N
    o_offs = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    p_offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    o_mask = mask_m[:, None] & mask_n[None, :]
    tile = pid_m * tl.num_programs(0) + pid_n
    store_split(acc, o_offs, p_offs, o_mask, out_ptr, ws_ptr, counter_ptr, M.to(tl.int64) * N,
                split_k, pid_k, tile)  # fmt: skip


@triton.jit(do_not_specialize=["M", "split_k", "k_tiles"])
def _int_linear_kernel(
    x_ptr,  # [M, K], unit stride along K
    w_ptr,  # [N, K / 2] (4-bit) or [N, K] (8-bit) codes
    s_ptr,  # [N, G] scales, or [N, G, 2] (s, z) with ZP
    out_ptr,  # [M, N], unit stride along N
    ws_ptr,  # [split_k, M, N] float32 partials (split_k > 1)
    counter_ptr,  # [>= tiles] int32, zero between calls
    M,
    N,
    K,
    k_tiles,  # BLOCK_K tiles per K-slice
    split_k,
    stride_xm,
    stride_om,
    BITS: tl.constexpr,  # 4 or 8
    ZP: tl.constexpr,  # a zero point per group beside the scale
    ZERO: tl.constexpr,  # the fixed zero point without ZP (8 for int4, 0 for int8)
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BITS_DEQUANT: tl.constexpr,  # 4-bit dot tiles through the mantissa (IntLaunch.dequant)
    SWAP: tl.constexpr,  # dot tiles: the weight as the left operand (IntLaunch.swap)
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    groups = K // GROUP
    WIDTH: tl.constexpr = BLOCK_K // 2 if BITS == 4 else BLOCK_K  # code bytes a tile row
    offs_j = tl.arange(0, WIDTH)
    row_bytes = K // 2 if BITS == 4 else K
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * row_bytes  # [BN, 1]
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_begin = pid_k * k_tiles * BLOCK_K
    for t in range(0, k_tiles):
        k0 = k_begin + t * BLOCK_K
        group = k0 // GROUP
        if ZP:
            s_offs = (offs_n.to(tl.int64) * groups + group) * 2
            scale = tl.load(s_ptr + s_offs, mask=mask_n, other=0.0)
            zero = tl.load(s_ptr + s_offs + 1, mask=mask_n, other=0.0)[:, None]  # [BN, 1]
        else:
            scale = tl.load(s_ptr + offs_n.to(tl.int64) * groups + group, mask=mask_n, other=0.0)
            zero = ZERO
        if BITS == 4 and BITS_DEQUANT:
            # A code c OR-ed into the mantissa of 2^E (E: 7 in bf16, whose mantissa steps by 1
            # from 128; 10 in fp16, from 1024) reads as 2^E + c: no integer-to-float
            # conversion, whose throughput is an eighth of an FMA's. Subtracting 2^E + zero
            # is exact (small whole numbers). The two nibbles join into [BN, BK] columns in
            # order, so the activation tile loads contiguous and one dot takes it.
            b = tl.load(w_rows + (k0 // 2 + offs_j)[None, :], mask=mask_n[:, None], other=0)
            x_dtype = x_ptr.dtype.element_ty
            if x_dtype == tl.bfloat16:
                base: tl.constexpr = 0x4300  # 128.0
                power: tl.constexpr = 128.0
            else:
                base: tl.constexpr = 0x6400  # 1024.0 in fp16
                power: tl.constexpr = 1024.0
            lo = ((b & 15).to(tl.uint16) | base).to(x_dtype, bitcast=True)
            hi = ((b >> 4).to(tl.uint16) | base).to(x_dtype, bitcast=True)
            w = tl.reshape(tl.join(lo, hi), [BLOCK_N, BLOCK_K])
            if ZP:  # noqa: SIM108 (a constexpr branch: zero is a constexpr int without ZP)
                w = w - (zero + power).to(x_dtype)
            else:
                w = w - (ZERO + power)
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None], other=0.0)
            part = _mma(xk, w, SWAP)
        elif BITS == 4:
            b = tl.load(w_rows + (k0 // 2 + offs_j)[None, :], mask=mask_n[:, None], other=0)
            lo = (b & 15).to(tl.float32) - zero  # [BN, BK / 2]: columns k0 + 2 j
            hi = (b >> 4).to(tl.float32) - zero  # columns k0 + 2 j + 1
            x_cols = x_rows + (k0 + 2 * offs_j)[None, :]
            xe = tl.load(x_cols, mask=mask_m[:, None], other=0.0)  # [BM, BK / 2]
            xo = tl.load(x_cols + 1, mask=mask_m[:, None], other=0.0)
            part = _mma(xe, lo.to(xe.dtype), SWAP)
            part += _mma(xo, hi.to(xo.dtype), SWAP)
        else:
            q = tl.load(w_rows + (k0 + offs_j)[None, :], mask=mask_n[:, None], other=0)
            w = q.to(tl.float32) - zero  # [BN, BK]
            xk = tl.load(x_rows + (k0 + offs_j)[None, :], mask=mask_m[:, None], other=0.0)
            part = _mma(xk, w.to(xk.dtype), SWAP)
        if SWAP:
            acc += part * scale[:, None]
        else:
            acc += part * scale[None, :]
    if SWAP:
        acc = tl.trans(acc)  # [BM, BN]
    _finish(acc, offs_m, offs_n, M, N, out_ptr, ws_ptr, counter_ptr, stride_om, split_k)


@triton.jit
def _columns(x, PER_WORD: tl.constexpr):
    """x [CW, PER_WORD] (4 or 8) -> its PER_WORD columns, each [CW], by halving splits (in
    registers when a thread holds its words' columns)."""
    cw: tl.constexpr = x.shape[0]
    even, odd = tl.split(tl.reshape(x, [cw, PER_WORD // 2, 2]))  # columns 0, 2, ... / 1, 3, ...
    if PER_WORD == 4:
        c0, c2 = tl.split(even)
        c1, c3 = tl.split(odd)
        c4, c5, c6, c7 = c0, c0, c0, c0  # unused
    else:
        e0, e1 = tl.split(tl.reshape(even, [cw, 2, 2]))  # columns 0, 4 / 2, 6
        o0, o1 = tl.split(tl.reshape(odd, [cw, 2, 2]))  # columns 1, 5 / 3, 7
        c0, c4 = tl.split(e0)
        c2, c6 = tl.split(e1)
        c1, c5 = tl.split(o0)
        c3, c7 = tl.split(o1)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _code_term(words, x_i, i: tl.constexpr, magic_bits, mask_bits, bias, BITS: tl.constexpr):
    """The i-th codes of [BN, CW] words as exact floats (c - zero), times their columns' x."""
    codes = (words >> (i * BITS)) & mask_bits
    return ((codes | magic_bits).to(tl.float32, bitcast=True) - bias) * x_i[None, :]


@triton.jit(do_not_specialize=["M", "split_k", "k_tiles"])
def _int_fma_kernel(
    x_ptr,  # [M, K], unit stride along K
    w_ptr,  # the codes' int32 view [N, K * BITS / 32]
    s_ptr,  # [N, G] scales, or [N, G, 2] (s, z) with ZP
    out_ptr,  # [M, N], unit stride along N
    ws_ptr,  # [split_k, M, N] float32 partials (split_k > 1)
    counter_ptr,  # [>= tiles] int32, zero between calls
    M,
    N,
    K,
    k_tiles,  # BLOCK_K tiles per K-slice
    split_k,
    stride_xm,
    stride_om,
    stride_wn,  # int32 words a weight row (K * BITS / 32: an argument, so its alignment is known)
    magic,  # 0x4B000000 (2^23 in float32) and the code mask, runtime values so that the
    code_mask,  # compiler ORs and masks in one LOP3 (with constants it emits a bit-field extract)
    flip,  # XOR-ed into each word: 0x80808080 turns int8 codes into q + 128, else 0
    BITS: tl.constexpr,  # 4 or 8
    ZP: tl.constexpr,  # a zero point per group beside the scale
    ZERO: tl.constexpr,  # the fixed zero point without ZP (8 for int4, 128 for flipped int8)
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # codes a row a tile, in one group: 4-32 words
):
    """The one-row form (a program per activation row): no tensor cores, and lanes over weight
    rows. A tile is [BLOCK_N rows, CW words]; a thread holds a row's words (16-byte loads) and
    the activations of their columns, which are the same for every row: one contiguous load a
    tile, shared by all lanes (with lanes along K, each code position's activations were a
    strided load of many cache lines, which cost more than the codes' arithmetic). For each
    code position i the codes are shifted out and OR-ed into float32's mantissa under 2^23 (one
    LOP3, no integer-to-float conversion, which Hopper issues at an eighth of the FMA rate),
    less 2^23 + zero (exact), times their columns' activations, into the thread's own
    accumulators; a tile's sum takes its group's scale, and the one reduction across threads is
    after the K loop. The next tile's words are loaded before this tile's are used (the
    pipeliner stages only loads that feed a dot)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    row = tl.program_id(2)
    PER_WORD: tl.constexpr = 32 // BITS
    CW: tl.constexpr = BLOCK_K // PER_WORD
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    groups = K // GROUP
    k_begin = pid_k * k_tiles * BLOCK_K
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + tl.arange(0, CW)[None, :]
    w_ptrs += k_begin // PER_WORD  # [BN, CW]: word j holds columns PER_WORD * j + i
    x_ptrs = x_ptr + row.to(tl.int64) * stride_xm + k_begin + tl.arange(0, BLOCK_K)
    s_rows = offs_n.to(tl.int64) * groups
    magic_bits = magic.to(tl.uint32, bitcast=True)
    mask_bits = code_mask.to(tl.uint32, bitcast=True)
    flip_bits = flip.to(tl.uint32, bitcast=True)
    acc = tl.zeros([BLOCK_N, CW], dtype=tl.float32)
    ahead = tl.load(w_ptrs, mask=mask_n[:, None], other=0)
    for t in range(0, k_tiles):
        words = ahead.to(tl.uint32, bitcast=True) ^ flip_bits
        w_ptrs += CW
        ahead = tl.load(w_ptrs, mask=mask_n[:, None] & (t + 1 < k_tiles), other=0)
        group = (k_begin + t * BLOCK_K) // GROUP
        if ZP:
            scale = tl.load(s_ptr + (s_rows + group) * 2, mask=mask_n, other=0.0)
            zero = tl.load(s_ptr + (s_rows + group) * 2 + 1, mask=mask_n, other=0.0)
            bias = (zero + 8388608.0)[:, None]
        else:
            scale = tl.load(s_ptr + s_rows + group, mask=mask_n, other=0.0)
            bias = 8388608.0 + ZERO
        xt = tl.reshape(tl.load(x_ptrs).to(tl.float32), [CW, PER_WORD])
        x_ptrs += BLOCK_K
        x0, x1, x2, x3, x4, x5, x6, x7 = _columns(xt, PER_WORD)
        part = _code_term(words, x0, 0, magic_bits, mask_bits, bias, BITS)
        part += _code_term(words, x1, 1, magic_bits, mask_bits, bias, BITS)
        part += _code_term(words, x2, 2, magic_bits, mask_bits, bias, BITS)
        part += _code_term(words, x3, 3, magic_bits, mask_bits, bias, BITS)
        if PER_WORD == 8:
            part += _code_term(words, x4, 4, magic_bits, mask_bits, bias, BITS)
            part += _code_term(words, x5, 5, magic_bits, mask_bits, bias, BITS)
            part += _code_term(words, x6, 6, magic_bits, mask_bits, bias, BITS)
            part += _code_term(words, x7, 7, magic_bits, mask_bits, bias, BITS)
        acc += part * scale[:, None]
    out = tl.sum(acc, axis=1)[None, :]  # [1, BN]
    _finish(out, row + tl.arange(0, 1), offs_n, M, N, out_ptr, ws_ptr, counter_ptr, stride_om,
            split_k)  # fmt: skip


INTERPRETED = not isinstance(_int_linear_kernel, JITFunction)
"""True when triton was imported with TRITON_INTERPRET=1: the kernel then runs on CPU tensors."""


# --------------------------------------------------------------------------- reference


def int_linear_ref(
    x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None, scheme: str
) -> Tensor:
    """What `int_linear` computes: quant_linear's reference (dequantize in float32, matmul,
    round to x's dtype)."""
    from compile_engine.models.quant import quant_linear_ref

    return quant_linear_ref(x, weight, weight_scale, None, bias, scheme)


# --------------------------------------------------------------------------- launch


@functools.cache
def launch_config(tuning_key: str, n_size: int, k_size: int, rows_bucket: int) -> IntLaunch:
    """The tuned config for this weight and row bucket (nearest M among entries of exactly
    this (N, K)); the table's default for the row class where none was tuned. The fma form
    serves one row only: it runs a program per row, so more rows would read the weight again
    each (batch 2 on the one-row gate_up entry: twice its 34 us, where the dot tile takes 41)."""
    table = tuning.resolve(tuning_key).table("int_gemm")
    section = table.targets.get("h100")
    entries = [
        e
        for e in (section.entries if section else [])
        if e.key["N"] == n_size
        and e.key["K"] == k_size
        and (rows_bucket <= FMA_MAX_ROWS or e.config["mode"] != "fma")
    ]
    if entries:
        best = min(entries, key=lambda e: abs(e.key["M"].bit_length() - rows_bucket.bit_length()))
        return IntLaunch(**best.config)
    if rows_bucket <= FMA_MAX_ROWS:
        name = "fma"
    elif rows_bucket <= SKINNY_MAX_ROWS:
        name = "skinny"
    else:
        name = "tiles"
    return IntLaunch(**table.default[name])


def _check(x: Tensor, weight: Tensor, weight_scale: Tensor, scheme: QuantScheme) -> None:
    if scheme.weight not in KERNEL_WEIGHTS or scheme.layout != "plain":
        raise IntLinearError(f"the integer linear kernel runs {', '.join(KERNEL_WEIGHTS)} in the "
                             f"plain layout, not {scheme}")  # fmt: skip
    if not (x.is_cuda or INTERPRETED):
        raise IntLinearError(
            "ce_kernels::int_linear runs on CUDA (or under TRITON_INTERPRET=1); on cpu the "
            "quantized_gemm pass lowers quant_linear to the CPU paths"
        )
    n, k = weight.shape[0], x.shape[-1]
    if tuple(weight.shape) != scheme.weight_shape(n, k):
        raise IntLinearError(f"weight {tuple(weight.shape)} for {k} input features ({scheme})")
    if tuple(weight_scale.shape) != scheme.scale_shape(n, k):
        raise IntLinearError(f"scales {tuple(weight_scale.shape)}, want "
                             f"{scheme.scale_shape(n, k)}")  # fmt: skip
    if weight_scale.dtype != torch.float32 or not weight.is_contiguous():
        raise IntLinearError("want float32 scales and a contiguous weight")


def run_int_linear(
    kernel_config: KernelConfig,
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    scheme: str,
    launch: IntLaunch | None = None,
) -> Tensor:
    """int_linear with an explicit kernel config (and optionally an explicit launch)."""
    parsed = QuantScheme.parse(scheme)
    _check(x, weight, weight_scale, parsed)
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows, k_size = flat.shape
    n_size = weight.shape[0]
    out = torch.empty(rows, n_size, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out.view(*x.shape[:-1], n_size)
    if launch is None:
        launch = launch_config(kernel_config.key, n_size, k_size, bucket_tokens(rows))
    fma = launch.mode == "fma"
    if fma:  # a tile of 4-32 int32 words a row, in one group
        per_word = 32 // parsed.bits
        block_k = min(launch.block_k, parsed.group, 32 * per_word)
        if block_k < 4 * per_word or k_size % block_k:
            raise IntLinearError(
                f"the FMA launch reads >= {4 * per_word} codes of a group at a time: {k_size} "
                f"input features, groups of {parsed.group}"
            )
        block_m = 1
    else:
        block_k = min(launch.block_k, parsed.group)  # a tile lies in one group
        if parsed.bits == 4 and block_k < 32:
            raise IntLinearError(
                f"{scheme}: 4-bit groups of {parsed.group} are too short for the tensor-core dot "
                "(16 columns a nibble half); groups of >= 32"
            )
        block_m = max(16, launch.block_m)
    n_tiles, m_tiles = triton.cdiv(n_size, launch.block_n), triton.cdiv(rows, block_m)
    total_k_tiles = k_size // block_k
    split_k = 1
    if launch.programs_per_sm:
        want = launch.programs_per_sm * sm_count(x.device)
        split_k = max(1, min(total_k_tiles, triton.cdiv(want, n_tiles * m_tiles)))
        while total_k_tiles % split_k:  # whole tiles a slice: no K masks
            split_k -= 1
    k_tiles = total_k_tiles // split_k
    workspace = out
    counters = arrival_counters("int_linear", x.device, MAX_TILES, IntLinearError)
    if split_k > 1:
        if n_tiles * m_tiles > MAX_TILES:
            raise IntLinearError(f"{n_tiles * m_tiles} tiles exceed the {MAX_TILES} counters")
        workspace = torch.empty(split_k, rows, n_size, dtype=torch.float32, device=x.device)
    grid = (n_tiles, split_k, m_tiles)
    common = (rows, n_size, k_size, k_tiles, split_k, flat.stride(0), out.stride(0))
    launch_options = dict(num_warps=launch.num_warps, num_stages=launch.num_stages)
    if fma:
        signed8 = parsed.weight == "int8"
        _int_fma_kernel[grid](
            flat,
            weight.view(torch.int32),
            weight_scale,
            out,
            workspace,
            counters,
            *common,
            weight.shape[1] // 4,
            0x4B000000,
            (1 << parsed.bits) - 1,
            -0x7F7F7F80 if signed8 else 0,  # 0x80808080 as an int32
            BITS=parsed.bits,
            ZP=parsed.has_zero,
            ZERO=128 if signed8 else (0 if parsed.has_zero else 8),
            GROUP=parsed.group,
            BLOCK_N=launch.block_n,
            BLOCK_K=block_k,
            **launch_options,
        )
    else:
        bits_dequant = launch.dequant == "bits" and parsed.bits == 4
        if bits_dequant and x.dtype not in (torch.bfloat16, torch.float16):
            raise IntLinearError(f"dequant 'bits' needs bf16 / fp16 activations, not {x.dtype}")
        _int_linear_kernel[grid](
            flat,
            weight,
            weight_scale,
            out,
            workspace,
            counters,
            *common,
            BITS=parsed.bits,
            ZP=parsed.has_zero,
            ZERO=0 if parsed.has_zero or parsed.weight == "int8" else 8,
            GROUP=parsed.group,
            BLOCK_M=block_m,
            BLOCK_N=launch.block_n,
            BLOCK_K=block_k,
            BITS_DEQUANT=bits_dequant,
            SWAP=launch.swap,
            **launch_options,
        )
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], n_size)


# The op the quantized_gemm pass swaps in for an integer ce.quant_linear on h100: opaque to
# Dynamo and Inductor, one call in the CUDA graph. `tuning_key`: the engine's KernelConfig.
@torch.library.custom_op("ce_kernels::int_linear", mutates_args=())
def int_linear(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    scheme: str,
    tuning_key: str,
) -> Tensor:
    """`run_int_linear` with the kernel config whose key the pass gave."""
    return run_int_linear(tuning.resolve(tuning_key), x, weight, weight_scale, bias, scheme)


@int_linear.register_fake
def _int_linear_fake(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    scheme: str,
    tuning_key: str,
) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
