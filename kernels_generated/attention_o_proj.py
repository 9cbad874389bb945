"""Decode attention fused into the o_proj GEMM, for one token (batch 1): an experiment.

At batch 1 a layer's attention is a chain of dependent steps on 8 programs (one per KV head)
while HBM idles, then o_proj streams its weight after it: on the H200 (scripts/device/
attention_probe.py, Llama-3-8B shapes, context 100) attention costs ~6 us of a 119 us layer
on the critical path and o_proj runs at ~3 TB/s. Here one launch does both: program (n, h)
owns o_proj output rows n * BLOCK_O ... and KV head h's columns of the o_proj weight (its
GROUP query heads x HEAD_DIM). Before its PDL wait it asks L2 for that weight slice; then it
computes KV head h's attention (every program of head h the same, from L2; the n == 0 one
writes the token's K and V to the cache), multiplies its slice by it and counts itself in on
row chunk n's counter: the last of the chunk's Hkv programs adds their partials in head order
and writes the output. The weight slice arrives while the attention runs.

Reference: `paged_attention_rotary_ref` (or `models.ops.paged_attention`) then F.linear, with
the attention output rounded to the activation dtype in between, as the two ops round it.
Only one token and one sequence, and only short contexts (every program recomputes its head's
attention, reading all of its keys).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels_generated.counters import arrival_counters
from kernels_generated.device import pdl_launch, pdl_mode
from kernels_generated.paged_attention import (
    _LOG2E,
    _MIN_DOT_ROWS,
    PagedAttentionKernelError,
    _attend_keys,
    _load_rotated,
    _rotary_args,
    _rotary_launch_args,
    _validate,
)

BLOCK_O = 128  # o_proj output rows a program
MAX_KEYS = 160  # the longest context it takes (each program reads all of its head's keys)


@triton.jit
def _prefetch_l2(ptrs):
    """Start fetching the 128-byte lines at `ptrs` into L2 (no registers wait for them)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _attention_o_proj_kernel(
    q_ptr,  # [1, Hq, D]
    k_new_ptr,  # [1, Hkv, D]
    v_new_ptr,
    slot_mapping_ptr,  # [1]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    block_tables_ptr,  # [1, max_blocks]
    seq_lens_ptr,  # [1]
    w_ptr,  # [N, Hq * D] o_proj weight
    out_ptr,  # [1, N]
    ws_ptr,  # [Hkv, N] float32 partials
    counters_ptr,  # [cdiv(N, BLOCK_O)] int32, zero between launches
    N,
    qk_scale,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_wn,
    positions_ptr,
    cos_sin_ptr,
    stride_cs,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_O: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROT_DIM: tl.constexpr = 0,
    ROTARY: tl.constexpr = False,
    PDL: tl.constexpr = 0,  # as the attention kernel's; 3 releases the next after the GEMM
    PREFETCH: tl.constexpr = False,  # the weight slice into L2 before the wait (GPU only)
    LINE: tl.constexpr = 64,  # weight elements a 128-byte line
    EARLY_TILE: tl.constexpr = False,  # the first query head's weight tile before the wait
    W_STAGES: tl.constexpr = 1,  # the weight loop's pipeline depth (GPU)
):
    pid_o = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    mask_o = offs_o < N
    offs_d = tl.arange(0, HEAD_DIM)
    offs_g = tl.arange(0, BLOCK_G)
    w_rows = w_ptr + offs_o[:, None].to(tl.int64) * stride_wn + kv_head * GROUP * HEAD_DIM
    if PREFETCH:
        lines = tl.arange(0, HEAD_DIM // LINE) * LINE
        for g in tl.static_range(GROUP):
            _prefetch_l2(w_rows + g * HEAD_DIM + lines[None, :])
    if EARLY_TILE:
        # Query head 0's columns into registers before the wait: nothing ahead writes them.
        w0 = tl.load(w_rows + offs_d[None, :], mask=mask_o[:, None], other=0.0)
    if PDL > 0:
        tl.extra.cuda.gdc_wait()

    seq_len = tl.load(seq_lens_ptr)
    context_len = seq_len - 1  # keys already in the cache; the token's own is the last
    heads = kv_head * GROUP + offs_g
    head_mask = offs_g < GROUP
    k_new_ptr += kv_head * stride_kh
    v_new_ptr += kv_head * stride_vh
    k_cache_ptr += kv_head * stride_cache_head
    v_cache_ptr += kv_head * stride_cache_head
    token_pos = 0  # unused without ROTARY
    if ROTARY:
        token_pos = tl.load(positions_ptr)
    k_row = _load_rotated(k_new_ptr, offs_d, token_pos, offs_d < HEAD_DIM, cos_sin_ptr,
                          stride_cs, ROT_DIM, ROTARY)  # fmt: skip
    v_row = tl.load(v_new_ptr + offs_d)
    if pid_o == 0:
        slot = tl.load(slot_mapping_ptr).to(tl.int64)
        dst = (
            (slot // KV_BLOCK_SIZE) * stride_cache_block
            + (slot % KV_BLOCK_SIZE) * stride_cache_slot
            + offs_d
        )
        tl.store(k_cache_ptr + dst, k_row.to(k_cache_ptr.dtype.element_ty))
        tl.store(v_cache_ptr + dst, v_row.to(v_cache_ptr.dtype.element_ty))
    q = _load_rotated(q_ptr + heads[:, None] * stride_qh, offs_d[None, :], token_pos,
                      head_mask[:, None], cos_sin_ptr, stride_cs, ROT_DIM, ROTARY)  # fmt: skip
    if COMPUTE_F32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    m_i, l_i, acc = _attend_keys(
        q, m_i, l_i, acc, 0, context_len, m_i, context_len, 0, block_tables_ptr, k_cache_ptr,
        v_cache_ptr, k_new_ptr, v_new_ptr, stride_cache_block, stride_cache_slot, stride_kt,
        stride_vt, qk_scale, positions_ptr, cos_sin_ptr, stride_cs, False, KV_BLOCK_SIZE,
        BLOCK_N, HEAD_DIM, COMPUTE_F32, DOT_PRECISION, ROT_DIM, ROTARY,
    )  # fmt: skip
    # The token's own key, from registers.
    s_own = tl.sum(q.to(tl.float32) * k_row.to(tl.float32)[None, :], 1) * qk_scale
    m_new = tl.maximum(m_i, s_own)
    alpha = tl.exp2(m_i - m_new)
    p_own = tl.exp2(s_own - m_new)
    l_i = l_i * alpha + p_own
    acc = acc * alpha[:, None] + p_own[:, None] * v_row.to(tl.float32)[None, :]
    # Rounded to the activation dtype, as the attention op's output is.
    attn = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)

    part = tl.zeros([BLOCK_O], tl.float32)
    first = 0
    if EARLY_TILE:
        a = tl.sum(tl.where(offs_g[:, None] == 0, attn, 0.0), axis=0)
        part += tl.sum(w0.to(tl.float32) * a[None, :], axis=1)
        first = 1
    if COMPUTE_F32:
        for g in range(first, GROUP):
            a = tl.sum(tl.where(offs_g[:, None] == g, attn, 0.0), axis=0)  # query head g's
            w = tl.load(w_rows + g * HEAD_DIM + offs_d[None, :], mask=mask_o[:, None], other=0.0)
            part += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
    else:
        for g in tl.range(first, GROUP, num_stages=W_STAGES):
            a = tl.sum(tl.where(offs_g[:, None] == g, attn, 0.0), axis=0)  # query head g's
            w = tl.load(w_rows + g * HEAD_DIM + offs_d[None, :], mask=mask_o[:, None], other=0.0)
            part += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
    if PDL == 3:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(ws_ptr + kv_head * N + offs_o, part, mask=mask_o)
    # The last of row chunk pid_o's Hkv programs adds the partials in head order. The barrier
    # puts every thread's partial store before the counter's (release) add.
    tl.debug_barrier()
    counter = counters_ptr + pid_o
    if tl.atomic_add(counter, 1, sem="acq_rel") == NUM_KV_HEADS - 1:
        total = tl.zeros([BLOCK_O], tl.float32)
        for h in range(NUM_KV_HEADS):
            total += tl.load(ws_ptr + h * N + offs_o, mask=mask_o, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + offs_o, total.to(out_ptr.dtype.element_ty), mask=mask_o)
        tl.atomic_xchg(counter, 0)  # zero again for the next launch


def attention_o_proj(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    w_o: Tensor,
    *,
    positions: Tensor | None = None,
    cos_sin_cache: Tensor | None = None,
    block_n: int = 64,
    num_warps: int = 8,
    early_tile: bool = False,
    w_stages: int = 1,
    prefetch: bool = True,
) -> Tensor:
    """F.linear(paged_attention(q, k, v, ...).reshape(1, -1), w_o) for one decode token of
    one sequence of at most MAX_KEYS keys (q [1, Hq, D], k and v [1, Hkv, D]); writes k and v
    into kv_cache as paged attention does. With positions and cos_sin_cache q and k arrive
    unrotated, as `paged_attention_triton` takes them. Returns [1, N]."""
    rotary = _rotary_args(q, positions, cos_sin_cache)
    _validate(q, k, v, kv_cache, block_tables)
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    if num_tokens != 1 or block_tables.shape[0] != 1:
        raise PagedAttentionKernelError(
            f"attention_o_proj takes one token of one sequence; got {num_tokens} tokens, "
            f"{block_tables.shape[0]} sequences (use paged_attention_triton and a linear)"
        )
    if block_tables.shape[1] * block_size > MAX_KEYS:
        raise PagedAttentionKernelError(
            f"attention_o_proj reads every key in each program: a table of at most {MAX_KEYS} "
            f"keys, got {block_tables.shape[1] * block_size}"
        )
    n_size = w_o.shape[0]
    if w_o.shape[1] != num_q_heads * head_dim or w_o.stride(-1) != 1:
        raise PagedAttentionKernelError(
            f"w_o must be [N, {num_q_heads * head_dim}] contiguous along its rows; got "
            f"{tuple(w_o.shape)} with strides {w_o.stride()}"
        )
    k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    on_cpu = q.device.type == "cpu"
    group = num_q_heads // num_kv_heads
    chunks = triton.cdiv(n_size, BLOCK_O)
    out = torch.empty(1, n_size, dtype=q.dtype, device=q.device)
    ws = torch.empty(num_kv_heads, n_size, dtype=torch.float32, device=q.device)
    counters = arrival_counters("attention_o_proj", q.device, chunks, PagedAttentionKernelError)
    rotary_ptrs, rotary_consts = _rotary_launch_args(rotary, slot_mapping)
    pdl = pdl_mode(q.device, 1, attention=True)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _attention_o_proj_kernel[(chunks, num_kv_heads)](
            q, k, v, slot_mapping, k_cache, v_cache, block_tables, seq_lens, w_o, out, ws,
            counters, n_size, scale * _LOG2E, q.stride(1), k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), *k_cache.stride()[:3], w_o.stride(0), *rotary_ptrs,
            NUM_KV_HEADS=num_kv_heads,
            GROUP=group,
            BLOCK_G=max(_MIN_DOT_ROWS, triton.next_power_of_2(group)),
            HEAD_DIM=head_dim,
            KV_BLOCK_SIZE=block_size,
            BLOCK_N=block_n,
            BLOCK_O=BLOCK_O,
            COMPUTE_F32=on_cpu,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 or on_cpu else "tf32",
            **rotary_consts,
            enable_fp_fusion=rotary is None,
            num_warps=num_warps,
            num_stages=2,
            PDL=pdl,
            PREFETCH=prefetch and pdl > 0 and head_dim % (128 // w_o.element_size()) == 0,
            LINE=128 // w_o.element_size(),
            EARLY_TILE=early_tile,
            W_STAGES=w_stages,
            **pdl_launch(pdl > 0),
        )  # fmt: skip
    return out
