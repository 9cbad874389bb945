"""MLA latent attention in Triton: H query heads against one shared latent "KV head" read in
place from the paged latent cache, one launch per layer for a packed batch.

Lowers `ce::mla_latent_attention` (reference: `models.mla.mla_latent_attention_ref`), the core
of the weight-absorbed form that passes/mla_absorb.py writes: each cached row is
[c_kv (R) | k_pe (P)]; the key is the whole row, the value its first R numbers. So a row is
loaded once per program and serves every head of the program, and no K or V is ever
materialised (R = kv_lora_rank 512, P = qk_rope_head_dim 64 in DeepSeek-V2/V3).

- Grid `(T, ceil(H / BLOCK_H), S)`: one program per query token and block of heads. A program
  finds its sequence by a binary search over `query_start_loc`, so the grid depends on shapes
  only and the launch is CUDA-graph safe (no `.item()`, no host branch on tensor values).
  Prefill chunks and decode tokens of one step share the launch.
- Scores `q_latent . c + q_pe . k_pe` as two tl.dot (R and P padded to powers of two >= 16
  and masked, so any sizes work); the value accumulator is [BLOCK_H, R] in float32.
- Softmax online in float32, in base 2 (scale folded with log2(e)).
- Any KV block size: each key position's slot goes through the block table.
- Padding: tokens at index >= query_start_loc[-1] belong to no sequence and come out zero.
- Split-KV when T * head blocks would leave SMs idle (decode at small batch): each split
  takes a contiguous share of the context and writes a partial (max, sum, unnormalised acc)
  to a float32 workspace; a reduce kernel combines them. Chosen from shapes only.

The latent write is `index_copy_` through `slot_mapping` before the launch, so a token sees
its own key; padding tokens write into block 0, the runtime's scratch.

On CPU the kernels run only under the Triton interpreter (`TRITON_INTERPRET=1` set before
triton is first imported), where tiles are cast to float32 after loading (the interpreter
computes bf16 wrongly). `check()` compares with the reference; `bench()` times it.

Measured on the H200 (`compile-engine bench mla`, bf16, DeepSeek-V2-Lite heads, decode, CUDA
graph replay): 0.020 ms at batch 1 (launch-bound), 0.174 ms at batch 64 with 4k contexts
(1.75 TB/s, 41% of the copy rate), 13-312x the naive up-projected reference; docs/mla.md.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

from compile_engine.kernels_generated.device import sm_count
from compile_engine.kernels_generated.paged_attention import compare_outputs, paged_layout
from compile_engine.kernels_generated.timing import event_seconds
from compile_engine.models.mla import mla_latent_attention_fake, mla_latent_attention_ref

_LOG2E = 1.4426950408889634
_MIN_DOT = 16  # tl.dot needs M, N, K >= 16
_MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed cost outweighs the parallelism it adds
_MAX_SPLITS = 64
_REDUCE_BLOCK_R = 128  # latent columns per reduce program

# One config per device type. CUDA: the best of BLOCK_N {16, 32, 64} x warps {4, 8} x stages
# {2, 3} at every one of DeepSeek-V2-Lite's decode shapes (batch 1/64, context 512/4k) on the
# H200 (`compile-engine bench mla --sweep`; docs/mla.md).
_CONFIGS = {
    "cuda": {"BLOCK_N": 64, "BLOCK_H": 16, "num_warps": 8, "num_stages": 2},
    "cpu": {"BLOCK_N": 16, "BLOCK_H": 16, "num_warps": 1, "num_stages": 1},
}


class MLAKernelError(RuntimeError):
    """The Triton MLA kernel cannot run these inputs here."""


# --------------------------------------------------------------------------- kernels


@triton.jit
def _attend_latent_tile(
    q_c,  # [BLOCK_H, BLOCK_R]
    q_pe,  # [BLOCK_H, BLOCK_P]
    m_i,  # [BLOCK_H] running max (base 2)
    l_i,  # [BLOCK_H] running sum
    acc,  # [BLOCK_H, BLOCK_R] float32, unnormalised
    start,
    key_hi,
    table_row,
    cache_ptr,
    stride_cache_block,
    stride_cache_slot,
    qk_scale,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over keys start .. start + BLOCK_N (those below key_hi)."""
    pos = start + tl.arange(0, BLOCK_N)
    valid = pos < key_hi
    block = tl.load(table_row + pos // KV_BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    row = block * stride_cache_block + (pos % KV_BLOCK_SIZE) * stride_cache_slot  # [BLOCK_N]
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    c = tl.load(
        cache_ptr + row[:, None] + offs_r[None, :],
        mask=valid[:, None] & (offs_r[None, :] < RANK),
        other=0.0,
    )  # [BLOCK_N, BLOCK_R]
    pe = tl.load(
        cache_ptr + row[:, None] + RANK + offs_p[None, :],
        mask=valid[:, None] & (offs_p[None, :] < ROPE),
        other=0.0,
    )  # [BLOCK_N, BLOCK_P]
    if COMPUTE_F32:
        c = c.to(tl.float32)
        pe = pe.to(tl.float32)

    scores = tl.dot(q_c, tl.trans(c), input_precision=DOT_PRECISION)
    scores += tl.dot(q_pe, tl.trans(pe), input_precision=DOT_PRECISION)
    scores = tl.where(valid[None, :], scores * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
    # Every step holds at least one valid key, so m_new is finite and alpha well defined.
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _mla_latent_kernel(
    q_ptr,  # [T, H, R + P]
    cache_ptr,  # [num_blocks, block_size, R + P]
    out_ptr,  # [T, H, R] (single pass) or unused (split)
    m_ws_ptr,  # [T, H, S] float32, split only
    l_ws_ptr,  # [T, H, S] float32, split only
    acc_ws_ptr,  # [T, H, S, R] float32, split only
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B]
    query_start_loc_ptr,  # [B + 1]
    num_seqs,
    num_heads,
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cache_block,
    stride_cache_slot,
    stride_bt,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,  # 1: write the output; > 1: write partials to the workspace
    COMPUTE_F32: tl.constexpr,  # interpreter: cast tiles to float32 after loading
    DOT_PRECISION: tl.constexpr,
):
    token = tl.program_id(0)
    head_block = tl.program_id(1)

    # The sequence owning this token: the last b with query_start_loc[b] <= token (padding
    # sequences have q_len 0, so equal starts are skipped by taking the last such b).
    lo = token * 0
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        take = tl.load(query_start_loc_ptr + mid) <= token
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid)
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Query i of a sequence sits at position seq_len - q_len + i and sees keys 0..position;
    # tokens past query_start_loc[-1] are padding: no keys, a zero output.
    num_keys = seq_len - (q_end - q_start) + (token - q_start) + 1
    num_keys = tl.where(token < q_end, num_keys, 0)
    num_keys = tl.minimum(tl.maximum(num_keys, 0), seq_len)

    key_lo = num_keys * 0
    key_hi = num_keys
    if NUM_SPLITS > 1:
        split = tl.program_id(2)
        per_split = tl.cdiv(tl.cdiv(num_keys, NUM_SPLITS), BLOCK_N) * BLOCK_N
        key_lo = split * per_split
        key_hi = tl.minimum(key_lo + per_split, num_keys)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    q_row = q_ptr + token * stride_qt + heads[:, None] * stride_qh
    q_c = tl.load(
        q_row + offs_r[None, :], mask=head_mask[:, None] & (offs_r[None, :] < RANK), other=0.0
    )
    q_pe = tl.load(
        q_row + RANK + offs_p[None, :],
        mask=head_mask[:, None] & (offs_p[None, :] < ROPE),
        other=0.0,
    )
    if COMPUTE_F32:
        q_c = q_c.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if COMPUTE_F32:
        # Interpreter: a `range` over loaded scalars calls int() on a one-element array, which
        # NumPy >= 2.5 refuses; a while loop avoids it.
        start = key_lo
        while start < key_hi:
            m_i, l_i, acc = _attend_latent_tile(
                q_c, q_pe, m_i, l_i, acc, start, key_hi, table_row, cache_ptr,
                stride_cache_block, stride_cache_slot, qk_scale, RANK, ROPE, BLOCK_R, BLOCK_P,
                KV_BLOCK_SIZE, BLOCK_N, COMPUTE_F32, DOT_PRECISION,
            )  # fmt: skip
            start += BLOCK_N
    else:
        # GPU: a for loop, which Triton software-pipelines over num_stages (a while loop not).
        for start in range(key_lo, key_hi, BLOCK_N):
            m_i, l_i, acc = _attend_latent_tile(
                q_c, q_pe, m_i, l_i, acc, start, key_hi, table_row, cache_ptr,
                stride_cache_block, stride_cache_slot, qk_scale, RANK, ROPE, BLOCK_R, BLOCK_P,
                KV_BLOCK_SIZE, BLOCK_N, COMPUTE_F32, DOT_PRECISION,
            )  # fmt: skip

    r_mask = offs_r[None, :] < RANK
    if NUM_SPLITS > 1:
        # Partials of an empty split stay (-inf, 0, 0): the reduce gives them weight zero.
        row_ids = (token * num_heads + heads) * NUM_SPLITS + split
        tl.store(m_ws_ptr + row_ids, m_i, mask=head_mask)
        tl.store(l_ws_ptr + row_ids, l_i, mask=head_mask)
        tl.store(
            acc_ws_ptr + row_ids[:, None] * RANK + offs_r[None, :],
            acc,
            mask=head_mask[:, None] & r_mask,
        )
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + token * stride_ot + heads[:, None] * stride_oh + offs_r[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=head_mask[:, None] & r_mask,
        )


@triton.jit
def _reduce_splits_kernel(
    out_ptr,  # [T, H, R]
    m_ws_ptr,  # [T, H, S]
    l_ws_ptr,
    acc_ws_ptr,  # [T, H, S, R]
    num_heads,
    stride_ot,
    stride_oh,
    RANK: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_RR: tl.constexpr,  # latent columns per program
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs_r = tl.program_id(2) * BLOCK_RR + tl.arange(0, BLOCK_RR)
    r_mask = offs_r < RANK
    offs_s = tl.arange(0, BLOCK_S)
    split_mask = offs_s < NUM_SPLITS
    base = (token * num_heads + head) * NUM_SPLITS
    m = tl.load(m_ws_ptr + base + offs_s, mask=split_mask, other=float("-inf"))
    sums = tl.load(l_ws_ptr + base + offs_s, mask=split_mask, other=0.0)
    acc = tl.load(
        acc_ws_ptr + (base + offs_s)[:, None] * RANK + offs_r[None, :],
        mask=split_mask[:, None] & r_mask[None, :],
        other=0.0,
    )
    m_max = tl.max(m, 0)
    # A padding token has no keys in any split: every max is -inf; keep exp2 away from NaN.
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp2(m - m_max)  # [BLOCK_S], 0 for empty splits
    total = tl.sum(sums * weight, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_r,
        out.to(out_ptr.dtype.element_ty),
        mask=r_mask,
    )


INTERPRETED = not isinstance(_mla_latent_kernel, JITFunction)
"""True when triton was imported with TRITON_INTERPRET=1: kernels then run on CPU tensors."""


# --------------------------------------------------------------------------- launcher


def choose_num_splits(
    num_tokens: int, num_head_blocks: int, max_context: int, device: torch.device
) -> int:
    """How many KV splits, from shapes only (the same at capture and replay); 1 = single
    pass. Splitting pays when the T * head-block programs would leave SMs idle; max_context
    is the block table's capacity, an upper bound on any sequence's length."""
    programs = num_tokens * num_head_blocks
    sms = sm_count(device)
    if programs >= sms:
        return 1
    splits = min(
        triton.cdiv(2 * sms, programs),
        triton.cdiv(max_context, _MIN_KEYS_PER_SPLIT),
        _MAX_SPLITS,
    )
    return max(splits, 1)


def _validate(
    q_latent: Tensor, kv_latent: Tensor, latent_cache: Tensor, block_tables: Tensor, rank: int
) -> None:
    num_tokens, _, width = q_latent.shape
    if latent_cache.dim() != 3 or latent_cache.shape[-1] != width or not 0 < rank < width:
        raise MLAKernelError(
            f"shape mismatch: q_latent {tuple(q_latent.shape)}, latent_cache "
            f"{tuple(latent_cache.shape)}, kv_lora_rank {rank} (want q_latent [T, H, R + P], "
            "cache [num_blocks, block_size, R + P])"
        )
    if kv_latent.shape != (num_tokens, width):
        raise MLAKernelError(f"kv_latent {tuple(kv_latent.shape)}, want {(num_tokens, width)}")
    if not latent_cache.is_contiguous():
        raise MLAKernelError("latent_cache must be contiguous (the engine allocates it so)")
    if block_tables.stride(-1) != 1:
        raise MLAKernelError("block_tables must be contiguous in its last dimension")
    if q_latent.device.type == "cpu" and not INTERPRETED:
        raise MLAKernelError(
            "the Triton MLA kernel runs on CPU tensors only under the interpreter: set "
            "TRITON_INTERPRET=1 before triton is first imported (or leave the mla_absorb pass "
            "on the cpu target, which uses the reference)"
        )
    if q_latent.device.type == "cpu" and q_latent.dtype == torch.bfloat16:
        raise MLAKernelError(
            "the Triton interpreter computes bfloat16 wrongly; use float32 or float16 on CPU"
        )


def mla_latent_attention_triton(
    q_latent: Tensor,
    kv_latent: Tensor,
    latent_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    kv_lora_rank: int,
    scale: float,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    block_h: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> Tensor:
    """Same contract as `models.mla.mla_latent_attention`: writes kv_latent into the cache
    through slot_mapping, returns [T, H, R]. num_splits: None chooses from shapes, 1 forces
    the single pass. The keyword tiles override the device's config (for tuning)."""
    _validate(q_latent, kv_latent, latent_cache, block_tables, kv_lora_rank)
    num_tokens, num_heads, width = q_latent.shape
    num_blocks, block_size, _ = latent_cache.shape
    rank, rope = kv_lora_rank, width - kv_lora_rank

    flat = latent_cache.view(num_blocks * block_size, width)
    flat.index_copy_(0, slot_mapping, kv_latent.to(latent_cache.dtype))

    out = q_latent.new_empty(num_tokens, num_heads, rank)
    if num_tokens == 0:
        return out
    if q_latent.stride(-1) != 1:
        q_latent = q_latent.contiguous()
    on_cpu = q_latent.device.type == "cpu"
    config = dict(_CONFIGS["cpu" if on_cpu else "cuda"])
    for key, value in (
        ("BLOCK_N", block_n), ("BLOCK_H", block_h), ("num_warps", num_warps),
        ("num_stages", num_stages),
    ):  # fmt: skip
        if value is not None:
            config[key] = value
    block_h = max(_MIN_DOT, min(config["BLOCK_H"], triton.next_power_of_2(num_heads)))
    head_blocks = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(num_tokens, head_blocks, max_context, q_latent.device)
    if num_splits < 1:
        raise MLAKernelError(f"num_splits must be >= 1, got {num_splits}")
    # float32 inputs keep full precision on GPU (tf32 would lose ~3 digits); bf16/fp16 take
    # the tensor-core path, where the precision flag has no effect.
    dot_precision = "ieee" if q_latent.dtype == torch.float32 or on_cpu else "tf32"

    if num_splits > 1:
        m_ws = torch.empty(
            (num_tokens, num_heads, num_splits), dtype=torch.float32, device=q_latent.device
        )
        l_ws = torch.empty_like(m_ws)
        acc_ws = torch.empty(
            (num_tokens, num_heads, num_splits, rank), dtype=torch.float32, device=q_latent.device
        )
    else:
        m_ws = l_ws = acc_ws = out  # never touched by the single-pass kernel

    grid = (num_tokens, head_blocks, num_splits)
    device_ctx = (
        torch.cuda.device(q_latent.device) if q_latent.is_cuda else contextlib.nullcontext()
    )
    with device_ctx:
        _mla_latent_kernel[grid](
            q_latent,
            latent_cache,
            out,
            m_ws,
            l_ws,
            acc_ws,
            block_tables,
            seq_lens,
            query_start_loc,
            block_tables.shape[0],
            num_heads,
            scale * _LOG2E,
            q_latent.stride(0),
            q_latent.stride(1),
            out.stride(0),
            out.stride(1),
            latent_cache.stride(0),
            latent_cache.stride(1),
            block_tables.stride(0),
            RANK=rank,
            ROPE=rope,
            BLOCK_R=max(_MIN_DOT, triton.next_power_of_2(rank)),
            BLOCK_P=max(_MIN_DOT, triton.next_power_of_2(rope)),
            BLOCK_H=block_h,
            KV_BLOCK_SIZE=block_size,
            BLOCK_N=config["BLOCK_N"],
            NUM_SPLITS=num_splits,
            COMPUTE_F32=on_cpu,
            DOT_PRECISION=dot_precision,
            num_warps=config["num_warps"],
            num_stages=config["num_stages"],
        )
        if num_splits > 1:
            block_rr = min(_REDUCE_BLOCK_R, triton.next_power_of_2(rank))
            _reduce_splits_kernel[(num_tokens, num_heads, triton.cdiv(rank, block_rr))](
                out,
                m_ws,
                l_ws,
                acc_ws,
                num_heads,
                out.stride(0),
                out.stride(1),
                RANK=rank,
                NUM_SPLITS=num_splits,
                BLOCK_S=triton.next_power_of_2(num_splits),
                BLOCK_RR=block_rr,
                num_warps=1 if on_cpu else 4,
            )
    return out


# The op the MLA pass emits on h100: same schema as ce::mla_latent_attention, opaque to Dynamo
# and Inductor (torch.library.triton_op fails under torch.compile on CPU).
@torch.library.custom_op("ce_kernels::mla_latent_attention", mutates_args=("latent_cache",))
def mla_latent_attention(
    q_latent: Tensor,
    kv_latent: Tensor,
    latent_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    kv_lora_rank: int,
    scale: float,
) -> Tensor:
    """`ce::mla_latent_attention` computed by the Triton kernel (split-KV chosen from shapes)."""
    return mla_latent_attention_triton(
        q_latent, kv_latent, latent_cache, slot_mapping, block_tables, seq_lens,
        query_start_loc, kv_lora_rank, scale,
    )  # fmt: skip


mla_latent_attention.register_fake(mla_latent_attention_fake)


# --------------------------------------------------------------------------- inputs, check, bench


@dataclass(slots=True)
class LatentBatch:
    """One packed step's inputs for the latent op, laid out the way the runtime builds them."""

    q_latent: Tensor
    kv_latent: Tensor
    latent_cache: Tensor
    slot_mapping: Tensor
    block_tables: Tensor
    seq_lens: Tensor
    query_start_loc: Tensor
    kv_lora_rank: int
    scale: float

    def args(self, latent_cache: Tensor | None = None) -> tuple:
        cache = self.latent_cache if latent_cache is None else latent_cache
        return (
            self.q_latent,
            self.kv_latent,
            cache,
            self.slot_mapping,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.kv_lora_rank,
            self.scale,
        )

    def latent_bytes_read(self) -> int:
        """Cache bytes attention reads: every sequence's whole context, once per head block
        (host-side sum of seq_lens: for reporting, never on the launch path)."""
        tokens = int(self.seq_lens.sum())
        return tokens * self.latent_cache.shape[-1] * self.latent_cache.element_size()


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int = 4,
    kv_lora_rank: int = 32,
    rope_dim: int = 16,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    pad_tokens: int = 0,
    pad_seqs: int = 0,
    table_width: int | None = None,
    num_blocks: int | None = None,
    qk_head_dim: int | None = None,
    seed: int = 0,
) -> LatentBatch:
    """Random inputs for sequences with the given new-token counts and context lengths
    (seq_len includes the new tokens). Blocks are handed out scrambled from 1 (block 0 is the
    scratch block padding writes into); pad_tokens are appended past query_start_loc[-1] with
    slots in block 0, pad_seqs with q_len 0 and seq_len 0. The scale is that of a query head
    of qk_head_dim (default R + P)."""
    layout = paged_layout(
        q_lens, seq_lens, block_size=block_size, device=device, pad_tokens=pad_tokens,
        pad_seqs=pad_seqs, table_width=table_width, num_blocks=num_blocks, seed=seed,
    )  # fmt: skip
    num_tokens = layout.num_tokens
    row = kv_lora_rank + rope_dim

    # Drawn on the device: a multi-GB cache drawn on the host would take minutes.
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    return LatentBatch(
        q_latent=randn(num_tokens, num_heads, row),
        kv_latent=randn(num_tokens, row),
        latent_cache=randn(layout.num_blocks, block_size, row),
        slot_mapping=layout.slot_mapping,
        block_tables=layout.block_tables,
        seq_lens=layout.seq_lens,
        query_start_loc=layout.query_start_loc,
        kv_lora_rank=kv_lora_rank,
        scale=1.0 / math.sqrt(qk_head_dim or row),
    )


def check(
    batch: LatentBatch, *, num_splits: int | None = None, atol: float | None = None, **tiles
) -> dict[str, float]:
    """Run the kernel and the reference on copies of the cache; raise AssertionError if the
    outputs or the written caches differ. Returns max abs error and cosine similarity."""
    cache_ref, cache_out = batch.latent_cache.clone(), batch.latent_cache.clone()
    expected = mla_latent_attention_ref(*batch.args(cache_ref))
    got = mla_latent_attention_triton(*batch.args(cache_out), num_splits=num_splits, **tiles)
    return compare_outputs(got, expected, (cache_out, cache_ref), "latent cache", atol)


def bench(
    batch: LatentBatch,
    *,
    fn=None,
    warmup: int = 3,
    iters: int = 20,
    inner: int = 10,
    cuda_graph: bool = False,
) -> dict[str, float]:
    """Time `fn(*batch.args())` (default: the Triton kernel) on CUDA: the median over `iters`
    samples of `inner` back-to-back calls between two CUDA events, and the achieved bandwidth
    (latent bytes read + q and out bytes) / time. cuda_graph=True captures one call and
    replays it, as the engine runs decode."""
    fn = mla_latent_attention_triton if fn is None else fn
    call = functools.partial(fn, *batch.args())
    seconds = event_seconds(call, cuda_graph=cuda_graph, warmup=warmup, iters=iters, inner=inner)
    q = batch.q_latent
    moved = batch.latent_bytes_read() + 2 * q.numel() * q.element_size()
    return {"seconds": seconds, "gb_s": moved / seconds / 1e9}
