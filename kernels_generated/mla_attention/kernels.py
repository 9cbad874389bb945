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
  to a float32 workspace; a reduce kernel combines them. Chosen from shapes only, by paged
  attention's policy with MLA's numbers (the kernel config's `MlaTuning`).

The latent write is `index_copy_` through `slot_mapping` before the launch, so a token sees
its own key; padding tokens write into block 0, the runtime's scratch.

On CPU the kernels run only under the Triton interpreter (`TRITON_INTERPRET=1` set before
triton is first imported), where tiles are cast to float32 after loading (the interpreter
computes bf16 wrongly).

Measured on the H200 (`compile-engine bench mla`, bf16, DeepSeek-V2-Lite heads, decode, CUDA
graph replay): 0.020 ms at batch 1 (launch-bound), 0.174 ms at batch 64 with 4k contexts
(1.75 TB/s, 41% of the copy rate), 13-312x the naive up-projected reference; docs/mla.md.

This module holds the kernels only: launch.py checks the inputs and launches them with the
launch code paged attention's launch.py shares, ops.py registers the custom op the mla_absorb
pass emits. Inputs and `check()` are in benchmarks/attention_inputs.py, `bench()` in
benchmarks/mla.py.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction


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
