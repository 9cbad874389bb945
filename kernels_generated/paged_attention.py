"""Paged attention in Triton: K/V read in place through the block table, one launch per batch.

Lowers `ce::paged_attention` (reference: `models.ops.paged_attention_ref`). One launch covers a
packed batch that mixes prefill chunks and decode tokens:

- Grid `(T, Hkv)`: one program per query token and KV head. A program finds its sequence by a
  binary search over `query_start_loc`, so the grid depends on shapes only and the launch is
  safe to capture in a CUDA graph (no `.item()`, no branching on tensor values on the host).
- GQA: a program owns every query head that shares its KV head, so each K/V tile is loaded once
  per group. The group (4 for Llama-3-8B) is padded to 16 rows, tl.dot's minimum, and masked.
  Decode is bound by K/V bandwidth, so the idle MMA rows cost nothing that shows; a
  broadcast-multiply-sum would hold a [G, BLOCK_N, D] float32 product in registers instead.
- Any KV block size (1, 3, 16, ...): every key position's slot goes through the block table
  (`block_tables[b, pos // block_size] * block_size + pos % block_size`), BLOCK_N keys a step.
- Softmax online in float32, in base 2 (scale folded with log2(e)).
- Padding: tokens at index >= query_start_loc[-1] belong to no sequence and come out zero;
  padding sequences (q_len 0, seq_len 0) own no token.
- Split-KV for long contexts at small batch: grid `(T, Hkv, S)`, S chosen from shapes only
  (when T * Hkv programs would leave SMs idle; the block table's width bounds the context).
  The kernel shares a sequence's keys among min(S, keys / MIN_SPLIT_KEYS) splits, computed
  from seq_len, so a short sequence in a wide table takes one split and the rest find no keys
  (they still wait for the kernel ahead and load the token's q, k and v, storing nothing).
  A table of at most UNSPLIT_KEYS keys runs unsplit where the launch's config sets that bound
  (on CUDA, launches of one token): the runner replays a graph captured on a table that
  narrow while a step's contexts fit (compiler/cuda_graphs.py; docs/compiler.md, section 6,
  item 10). A lone split writes the output; otherwise each writes a partial (max, sum,
  unnormalised acc) to a float32 workspace, and the last of them to finish (an atomic
  counter per (token, KV head), zeroed again by that program) combines them: no second
  kernel, no memset, CUDA-graph safe.

The KV write is fused: each token's program (the first split's) stores its own K and V at
its `slot_mapping` slot, and keys of the current step are read from the k/v inputs rather than
the cache (row `query_start + pos - context_len`), so no program reads what another program of
the same launch writes. Keys before `context_len` were written by earlier launches. Padding
tokens write into block 0, the runtime's scratch. (It replaced two `index_copy_` kernels per
layer: 140 / 184 / 280 us a step at batch 1 / 64 / 256 on the H200.) Cached and new keys run
in two loops (`_attend_keys`): one loop loading from both sources had the software pipeline
stage four tiles a step instead of two. A token's own key, the last it sees, is folded in from
the registers that hold it for the KV write, after the loops: a decode token's loop over this
step's keys then does nothing (H200, `bench breakdown`: attention 255 / 371 / 1,300 -> 235 /
351 / 1,215 us a step at batch 1 / 64 / 256).

Query-tiled prefill variant (`tiled=True`; chosen by shapes). The single-token kernel re-reads
a prefill chunk's keys once per query token with 16-row dots; this one runs a program per
(query tile, KV head), a tile being up to BLOCK_M consecutive tokens of one sequence, and puts
the tile's BLOCK_M tokens x group heads (the group rounded up to a power of two) on the dot's
rows, 64 on CUDA. Sequence b's tiles are numbered from `query_start_loc[b] // BLOCK_M + b` and
found by binary search, the padding past `query_start_loc[-1]` counting as one more sequence,
so the grid `(T // BLOCK_M + B + 1, Hkv)` is an upper bound from shapes only (programs without
a tile do nothing; CUDA-graph safe). Keys run up to the tile's last query position, masked
causally per row; the KV write is fused with the same contract (each token's K/V written once,
by its tile's program; this step's keys read from the k/v inputs). One-token (decode) sequences
are skipped: a second launch of the single-token kernel, gridded over sequences (`BY_SEQ`),
serves them, so a mixed batch's decodes waste no dot rows. The two launches touch disjoint
tokens. `choose_tiled` takes the variant for batches with at least two tokens per sequence
slot, never split. On the H200 at 9488c66 (bf16, Llama-3-8B heads) four 512-token chunks take
0.055 ms against 0.342 ms single-token, 0.321 against 2.479 after 2k tokens of context
(`compile-engine bench paged-attention --prefill`); a mixed offline step (3 chunks of 600 + 237
decodes at contexts 513-768) 245 us.

On CPU the kernels run only under the Triton interpreter (`TRITON_INTERPRET=1` set before
triton is first imported), which computes bf16 wrongly: there tiles are cast to float32 right
after loading. `check()` compares with the reference; `bench()` reports achieved GB/s.

Measured on the H200 at 9488c66 (`compile-engine bench paged-attention --contexts 100 640
4096 32768`, bf16 decode, Hq 32, Hkv 8, D 128, block 16, one context for every sequence,
CUDA-graph replay; paged_attention-nvidia-h200-9488c66.json): batch 256 reads 101-103% of the
4.26 TB/s copy rate at contexts 4k / 32k (1.00 / 7.87 ms a layer), 92% at 640 (0.172 ms), 53%
at 100 (0.048 ms: per-program fixed cost, not bandwidth); batch 64 91-95% at 4k / 32k;
batch 1 takes 8 us at context 100 and reads 64% at 32k (33 splits, 49 us). 3.3-4.1x the
reference gather + SDPA from 4k up. The configs chosen after that run (below) were faster
or equal at every shape of the sweep.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.counters import arrival_counters
from compile_engine.kernels_generated.device import pdl_launch, pdl_on, sm_count
from compile_engine.kernels_generated.rotary import rotary_triton
from compile_engine.kernels_generated.timing import event_seconds
from compile_engine.kernels_generated.tuning import KernelConfig
from compile_engine.models.ops import paged_attention_fake, paged_attention_ref, rotary_ref
from compile_engine.models.rope import cos_sin_table

_LOG2E = 1.4426950408889634
_MIN_DOT_ROWS = 16  # tl.dot needs M, N, K >= 16
# Launch configs, split policy and the tiled variant's threshold: the kernel config's
# AttentionTuning (kernels_generated/tuning.py), measured on the H200.


class PagedAttentionKernelError(RuntimeError):
    """The Triton paged-attention kernel cannot run these inputs here."""


# --------------------------------------------------------------------------- kernels


@triton.jit
def _load_rotated(
    row_ptr,  # each row's first element: a pointer, or a [R, 1] block of them
    d,  # column indices, broadcast against row_ptr ([D] or [1, D])
    pos,  # each row's position, shaped as row_ptr (read only with ROTARY)
    mask,
    cos_sin_ptr,  # [max_pos, ROT_DIM], cos half then sin half (read only with ROTARY)
    stride_cs,
    ROT_DIM: tl.constexpr,
    ROTARY: tl.constexpr,
):
    """Load rows of q or k; with ROTARY, rotated as `models.ops.rotary_ref` rotates them
    (neox style, columns past ROT_DIM unchanged): both products and their sum rounded to the
    input's dtype, as the reference's ops in that dtype round them, so the K written to the
    cache equals the reference's bit for bit."""
    x = tl.load(row_ptr + d, mask=mask, other=0.0)
    if ROTARY:
        half = ROT_DIM // 2
        in_rot = d < ROT_DIM
        first = d < half
        partner = tl.where(in_rot, tl.where(first, d + half, d - half), d)
        other = tl.load(row_ptr + partner, mask=mask, other=0.0)
        col = tl.where(in_rot, tl.where(first, d, d - half), 0)
        table = cos_sin_ptr + pos.to(tl.int64) * stride_cs + col
        cos = tl.load(table, mask=mask & in_rot, other=1.0).to(x.dtype).to(tl.float32)
        sin = tl.load(table + half, mask=mask & in_rot, other=0.0).to(x.dtype).to(tl.float32)
        rotated = tl.where(first, -other, other).to(tl.float32)  # rotate_half: [-x2, x1]
        a = (x.to(tl.float32) * cos).to(x.dtype).to(tl.float32)
        b = (rotated * sin).to(x.dtype).to(tl.float32)
        x = tl.where(in_rot, (a + b).to(x.dtype), x)
    return x


@triton.jit
def _attend_tile(
    q,  # [ROWS, D]
    m_i,  # [ROWS] running max (base 2)
    l_i,  # [ROWS] running sum
    acc,  # [ROWS, D] float32, unnormalised
    start,
    hi,
    row_last,  # [ROWS] last key position each row sees (CAUSAL only)
    context_len,
    new_row0,
    table_row,
    k_cache_ptr,  # offset to the program's KV head
    v_cache_ptr,
    k_new_ptr,  # offset to the program's KV head
    v_new_ptr,
    stride_cache_block,
    stride_cache_slot,
    stride_kt,
    stride_vt,
    qk_scale,
    positions_ptr,  # [T] each token's position (ROTARY only)
    cos_sin_ptr,
    stride_cs,
    FROM_CACHE: tl.constexpr,
    CAUSAL: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROT_DIM: tl.constexpr,
    ROTARY: tl.constexpr,
):
    """One online-softmax step over keys start .. start + BLOCK_N (those below hi). K and V
    come from the cache through the block table (FROM_CACHE: keys before context_len, which
    earlier steps wrote) or from the k/v inputs, row new_row0 + pos - context_len (this step's
    keys: the programs that write them to the cache run in this same launch)."""
    pos = start + tl.arange(0, BLOCK_N)
    valid = pos < hi
    offs_d = tl.arange(0, HEAD_DIM)[None, :]
    if FROM_CACHE:
        block = tl.load(table_row + pos // KV_BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        row = block * stride_cache_block + (pos % KV_BLOCK_SIZE) * stride_cache_slot
        k = tl.load(k_cache_ptr + row[:, None] + offs_d, mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + row[:, None] + offs_d, mask=valid[:, None], other=0.0)
    else:
        rows = (new_row0 + pos - context_len).to(tl.int64)
        key_pos = rows  # unused without ROTARY
        if ROTARY:
            key_pos = tl.load(positions_ptr + rows, mask=valid, other=0)
        k = _load_rotated(k_new_ptr + rows[:, None] * stride_kt, offs_d, key_pos[:, None],
                          valid[:, None], cos_sin_ptr, stride_cs, ROT_DIM, ROTARY)  # fmt: skip
        v = tl.load(v_new_ptr + rows[:, None] * stride_vt + offs_d, mask=valid[:, None], other=0.0)
    if COMPUTE_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    visible = valid[None, :]
    if CAUSAL:
        visible = visible & (pos[None, :] <= row_last[:, None])
    scores = tl.where(visible, scores, float("-inf"))  # [ROWS, BLOCK_N]
    # Every row sees a key in its first step (a decode row every valid key; a causal row key
    # 0 at least), so m_i is finite from then on and a later step a row sees nothing of
    # gives alpha 1, p 0.
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_span(
    q,
    m_i,
    l_i,
    acc,
    lo,
    hi,
    row_last,
    context_len,
    new_row0,
    table_row,
    k_cache_ptr,
    v_cache_ptr,
    k_new_ptr,
    v_new_ptr,
    stride_cache_block,
    stride_cache_slot,
    stride_kt,
    stride_vt,
    qk_scale,
    positions_ptr,
    cos_sin_ptr,
    stride_cs,
    FROM_CACHE: tl.constexpr,
    CAUSAL: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROT_DIM: tl.constexpr,
    ROTARY: tl.constexpr,
    LOOP_STAGES: tl.constexpr = None,  # the GPU loop's pipeline depth; None: the launch's
):
    """`_attend_tile` over keys lo .. hi, BLOCK_N at a time, from one source."""
    if COMPUTE_F32:
        # Interpreter: a `range` over loaded scalars calls int() on a one-element array, which
        # NumPy >= 2.5 refuses (triton 3.6 with numpy 2.5 fails so); while loops avoid it.
        start = lo
        while start < hi:
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, start, hi, row_last, context_len, new_row0, table_row,
                k_cache_ptr, v_cache_ptr, k_new_ptr, v_new_ptr, stride_cache_block,
                stride_cache_slot, stride_kt, stride_vt, qk_scale, positions_ptr, cos_sin_ptr,
                stride_cs, FROM_CACHE, CAUSAL, KV_BLOCK_SIZE, BLOCK_N, HEAD_DIM, COMPUTE_F32,
                DOT_PRECISION, ROT_DIM, ROTARY,
            )  # fmt: skip
            start += BLOCK_N
    else:
        # GPU: a for loop, which Triton software-pipelines over num_stages (a while loop not).
        for start in tl.range(lo, hi, BLOCK_N, num_stages=LOOP_STAGES):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, start, hi, row_last, context_len, new_row0, table_row,
                k_cache_ptr, v_cache_ptr, k_new_ptr, v_new_ptr, stride_cache_block,
                stride_cache_slot, stride_kt, stride_vt, qk_scale, positions_ptr, cos_sin_ptr,
                stride_cs, FROM_CACHE, CAUSAL, KV_BLOCK_SIZE, BLOCK_N, HEAD_DIM, COMPUTE_F32,
                DOT_PRECISION, ROT_DIM, ROTARY,
            )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _attend_keys(
    q,
    m_i,
    l_i,
    acc,
    lo,
    hi,
    row_last,
    context_len,
    new_row0,
    table_row,
    k_cache_ptr,
    v_cache_ptr,
    k_new_ptr,
    v_new_ptr,
    stride_cache_block,
    stride_cache_slot,
    stride_kt,
    stride_vt,
    qk_scale,
    positions_ptr,
    cos_sin_ptr,
    stride_cs,
    CAUSAL: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROT_DIM: tl.constexpr,
    ROTARY: tl.constexpr,
):
    """Online softmax over keys lo .. hi: a loop over the cached ones (below context_len),
    then one over this step's. Two loops, so each loads only K and V: with both sources in
    one loop, the software pipeline staged four [BLOCK_N, D] tiles in shared memory a step
    (the new-key pair almost always masked off), halving the programs an SM holds."""
    cache_hi = tl.minimum(hi, context_len)
    new_lo = tl.maximum(lo, context_len)
    m_i, l_i, acc = _attend_span(
        q, m_i, l_i, acc, lo, cache_hi, row_last, context_len, new_row0, table_row,
        k_cache_ptr, v_cache_ptr, k_new_ptr, v_new_ptr, stride_cache_block, stride_cache_slot,
        stride_kt, stride_vt, qk_scale, positions_ptr, cos_sin_ptr, stride_cs, True, CAUSAL,
        KV_BLOCK_SIZE, BLOCK_N, HEAD_DIM, COMPUTE_F32, DOT_PRECISION, ROT_DIM, ROTARY,
    )  # fmt: skip
    # This step's keys rotated as they load go in 16-key tiles, unpipelined. Pipelined
    # BLOCK_N tiles staged k, its partner half, cos and sin a stage: in an offline sm_90
    # compile (triton 3.6) 70 / 135 KB of shared memory a program against 21 / 39 KB without
    # rotary (BLOCK_N 32 / 64), the cause of a 3-4x slower kernel on the H200; 16-key
    # unpipelined tiles take 21 / 39 KB and 168 registers, no spills.
    ROTATED_TILES: tl.constexpr = ROTARY and not COMPUTE_F32
    m_i, l_i, acc = _attend_span(
        q, m_i, l_i, acc, new_lo, hi, row_last, context_len, new_row0, table_row,
        k_cache_ptr, v_cache_ptr, k_new_ptr, v_new_ptr, stride_cache_block, stride_cache_slot,
        stride_kt, stride_vt, qk_scale, positions_ptr, cos_sin_ptr, stride_cs, False, CAUSAL,
        KV_BLOCK_SIZE, 16 if ROTATED_TILES else BLOCK_N, HEAD_DIM, COMPUTE_F32, DOT_PRECISION,
        ROT_DIM, ROTARY, 1 if ROTATED_TILES else None,
    )  # fmt: skip
    return m_i, l_i, acc


# Arguments that change from step to step are not specialised on (Triton would compile a
# variant for each of "== 1", "divisible by 16" and neither, mid-run: a 1.1 s step on the H200).
_PER_STEP_ARGS = ["num_tokens", "num_seqs", "stride_bt"]


@triton.jit(do_not_specialize=_PER_STEP_ARGS)
def _paged_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_new_ptr,  # [T, Hkv, D] this step's keys (written to the cache here)
    v_new_ptr,
    slot_mapping_ptr,  # [T] int64 cache slot of each token
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    out_ptr,  # [T, Hq, D]
    m_ws_ptr,  # [T, Hq, S] float32, split only
    l_ws_ptr,  # [T, Hq, S] float32, split only
    acc_ws_ptr,  # [T, Hq, S, D] float32, split only
    counters_ptr,  # [>= T * Hkv] int32, zero between launches; split only
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B]
    query_start_loc_ptr,  # [B + 1]
    num_seqs,
    num_q_heads,
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt,
    positions_ptr,  # [T] each token's position (ROTARY only)
    cos_sin_ptr,  # [max_pos, ROT_DIM] (ROTARY only)
    stride_cs,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP padded to tl.dot's minimum
    HEAD_DIM: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,  # 1: one pass; > 1: up to NUM_SPLITS programs share the keys
    MIN_SPLIT_KEYS: tl.constexpr,  # a split takes at least this many keys
    COMBINE_G: tl.constexpr,  # GROUP rounded up to a power of two (the combine's rows)
    COMBINE_S: tl.constexpr,  # splits the combine loads at once (a power of two)
    COMPUTE_F32: tl.constexpr,  # interpreter: cast tiles to float32 after loading
    DOT_PRECISION: tl.constexpr,
    BY_SEQ: tl.constexpr = False,  # grid over sequences; only one-token sequences work
    ROT_DIM: tl.constexpr = 0,  # the rotary's width (ROTARY only)
    ROTARY: tl.constexpr = False,  # q and k arrive unrotated: rotate them here
    PDL: tl.constexpr = False,  # a PDL dependent: waits for the kernel ahead, releases the next
    # after the key loops (tuning.py)
):
    if PDL:
        tl.extra.cuda.gdc_wait()
    kv_head = tl.program_id(1)
    if BY_SEQ:
        # Beside the tiled kernel: program b serves sequence b's token if b decodes one token
        # this step; every other program does nothing (the tiled kernel owns its tokens).
        seq = tl.program_id(0)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_end = tl.load(query_start_loc_ptr + seq + 1)
        seq_len = tl.load(seq_lens_ptr + seq)
        token = q_start
        mine = (q_end - q_start) == 1
        num_keys = tl.where(mine, seq_len, 0)
    else:
        token = tl.program_id(0)
        # The sequence owning this token: the last b with query_start_loc[b] <= token.
        # Padding sequences have q_len 0, so equal starts are skipped by taking the last b.
        # First a guess, b = token, right for every decode before the batch's first prefill
        # chunk (the scheduler puts running decodes first): two independent loads instead of
        # log2(B) dependent ones. A hit is the only b whose range holds the token.
        guess = tl.minimum(token, num_seqs - 1)
        hit = (tl.load(query_start_loc_ptr + guess) <= token) & (
            token < tl.load(query_start_loc_ptr + guess + 1)
        )
        lo = tl.where(hit, guess, 0)
        hi = tl.where(hit, guess + 1, num_seqs)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            start_mid = tl.load(query_start_loc_ptr + mid)
            take = start_mid <= token
            lo = tl.where(take, mid, lo)
            hi = tl.where(take, hi, mid)
        seq = lo
        q_start = tl.load(query_start_loc_ptr + seq)
        q_end = tl.load(query_start_loc_ptr + seq + 1)
        seq_len = tl.load(seq_lens_ptr + seq)
        mine = token == token  # every token of the grid is this program's
        # Query i of a sequence sits at position seq_len - q_len + i and sees keys 0..position.
        num_keys = seq_len - (q_end - q_start) + (token - q_start) + 1
        # Tokens past query_start_loc[-1] are padding: no keys, so a zero output.
        num_keys = tl.where(token < q_end, num_keys, 0)
    num_keys = tl.minimum(tl.maximum(num_keys, 0), seq_len)

    key_lo = num_keys * 0
    key_hi = num_keys
    split = 0
    active = 1  # splits holding keys
    if NUM_SPLITS > 1:
        # A split's share comes from this sequence's length, not from the shapes: a short
        # sequence takes one split (the others find no keys and return), a long one all.
        split = tl.program_id(2)
        per_split = tl.maximum(tl.cdiv(num_keys, NUM_SPLITS), MIN_SPLIT_KEYS)
        per_split = tl.cdiv(per_split, BLOCK_N) * BLOCK_N
        active = tl.cdiv(num_keys, per_split)
        key_lo = split * per_split
        key_hi = tl.minimum(key_lo + per_split, num_keys)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    head_mask = offs_g < GROUP
    k_new_ptr += kv_head * stride_kh
    v_new_ptr += kv_head * stride_vh
    k_cache_ptr += kv_head * stride_cache_head
    v_cache_ptr += kv_head * stride_cache_head

    # The token's own K and V: key num_keys - 1 is the token itself (row `token` of k/v).
    token_pos = token  # unused without ROTARY
    if ROTARY:
        token_pos = tl.load(positions_ptr + token, mask=mine, other=0)
    k_row = _load_rotated(k_new_ptr + token.to(tl.int64) * stride_kt, offs_d, token_pos, mine,
                          cos_sin_ptr, stride_cs, ROT_DIM, ROTARY)  # fmt: skip
    v_row = tl.load(v_new_ptr + token.to(tl.int64) * stride_vt + offs_d, mask=mine, other=0.0)
    # The KV-cache write, fused: each token's (first-split) program stores its own K and V.
    # No program of this launch reads them back from the cache (see _attend_tile). Padding
    # tokens' slot is 0, the runtime's scratch block.
    if split == 0:
        slot = tl.load(slot_mapping_ptr + token, mask=mine, other=0).to(tl.int64)
        dst = (
            (slot // KV_BLOCK_SIZE) * stride_cache_block
            + (slot % KV_BLOCK_SIZE) * stride_cache_slot
            + offs_d
        )
        tl.store(k_cache_ptr + dst, k_row.to(k_cache_ptr.dtype.element_ty), mask=mine)
        tl.store(v_cache_ptr + dst, v_row.to(v_cache_ptr.dtype.element_ty), mask=mine)

    q = _load_rotated(
        q_ptr + token * stride_qt + heads[:, None] * stride_qh, offs_d[None, :], token_pos,
        head_mask[:, None] & mine, cos_sin_ptr, stride_cs, ROT_DIM, ROTARY,
    )  # fmt: skip
    if COMPUTE_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    context_len = seq_len - (q_end - q_start)  # keys already in the cache before this step
    # The split holding the last key takes the token's own key from registers (k_row, v_row)
    # after the tile loops: for a decode token the loop over this step's keys then has
    # nothing to do (at batch 256, context ~100, it was one tile step in five).
    own = (num_keys > 0) & (key_lo < key_hi) & (key_hi == num_keys)
    m_i, l_i, acc = _attend_keys(
        q, m_i, l_i, acc, key_lo, key_hi - own.to(tl.int32), m_i, context_len, q_start,
        table_row, k_cache_ptr, v_cache_ptr, k_new_ptr, v_new_ptr, stride_cache_block,
        stride_cache_slot, stride_kt, stride_vt, qk_scale, positions_ptr, cos_sin_ptr,
        stride_cs, False, KV_BLOCK_SIZE, BLOCK_N, HEAD_DIM, COMPUTE_F32, DOT_PRECISION,
        ROT_DIM, ROTARY,
    )  # fmt: skip
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if own:
        s_own = tl.sum(q.to(tl.float32) * k_row.to(tl.float32)[None, :], 1) * qk_scale
        m_new = tl.maximum(m_i, s_own)
        alpha = tl.exp2(m_i - m_new)
        p_own = tl.exp2(s_own - m_new)
        l_i = l_i * alpha + p_own
        acc = acc * alpha[:, None] + p_own[:, None] * v_row.to(tl.float32)[None, :]
        m_i = m_new

    out_ptrs = out_ptr + token * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    ws_rows = (token * num_q_heads + heads) * NUM_SPLITS  # [BLOCK_G] each head's split 0
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & mine)
    else:
        # The partials are combined by the last split of a (token, KV head) to finish, not by
        # a second kernel: one launch a layer, and a sequence short enough for one split
        # writes its output directly (1 x 100 keys: 10.4 against 13.2 us with a reduce
        # kernel, before 9488c66; at 1 x 32k the combine of 33 splits cost 2 us more).
        if active <= 1:
            # One split holds every key (or none: padding, a zero output): it writes the output.
            if split == 0:
                out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
                tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & mine)
        elif split < active:
            tl.store(m_ws_ptr + ws_rows + split, m_i, mask=head_mask)
            tl.store(l_ws_ptr + ws_rows + split, l_i, mask=head_mask)
            tl.store(acc_ws_ptr + (ws_rows + split)[:, None] * HEAD_DIM + offs_d[None, :], acc,
                     mask=head_mask[:, None])  # fmt: skip
            # The last of the active splits to finish combines the partials. The barrier puts
            # every thread's partial stores before the counter's (release) add.
            tl.debug_barrier()
            counter = counters_ptr + token * tl.num_programs(1) + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel") == active - 1:
                _combine_splits(
                    out_ptr + token * stride_ot, stride_oh, m_ws_ptr, l_ws_ptr, acc_ws_ptr,
                    (token * num_q_heads + kv_head * GROUP) * NUM_SPLITS, kv_head * GROUP,
                    active, GROUP, COMBINE_G, COMBINE_S, NUM_SPLITS, HEAD_DIM,
                )  # fmt: skip
                tl.atomic_xchg(counter, 0)  # zero again for the next launch


@triton.jit
def _combine_splits(
    out_ptr,  # the token's output row [Hq, D]
    stride_oh,
    m_ws_ptr,  # [T, Hq, S]
    l_ws_ptr,
    acc_ws_ptr,  # [T, Hq, S, D]
    ws_row0,  # the group's first head's split 0 in the workspace
    head0,  # the group's first query head
    active,
    GROUP: tl.constexpr,
    COMBINE_G: tl.constexpr,
    COMBINE_S: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """The group's output = its splits' partial outputs weighted by their softmax sums, for
    splits 0 .. active - 1 (each holds at least one key), COMBINE_S splits a load so the
    latency is paid once per COMBINE_S, not per split. Loads bypass L1 (.cg): other SMs
    wrote the partials during this launch."""
    offs_g = tl.arange(0, COMBINE_G)
    offs_d = tl.arange(0, HEAD_DIM)
    g_ok = offs_g < GROUP
    rows = ws_row0 + offs_g * NUM_SPLITS  # [G] each head's split 0
    m_max = tl.full([COMBINE_G], float("-inf"), tl.float32)
    s0 = active * 0
    while s0 < active:  # the max over the splits first: the weights need it
        offs_s = s0 + tl.arange(0, COMBINE_S)
        ok = g_ok[:, None] & (offs_s < active)[None, :]
        ms = tl.load(m_ws_ptr + rows[:, None] + offs_s[None, :], mask=ok, other=float("-inf"),
                     cache_modifier=".cg")  # fmt: skip
        m_max = tl.maximum(m_max, tl.max(ms, 1))
        s0 += COMBINE_S
    m_max = tl.where(g_ok, m_max, 0.0)  # padded rows: no splits, keep exp2 away from NaN
    total = tl.zeros([COMBINE_G], tl.float32)
    out = tl.zeros([COMBINE_G, HEAD_DIM], tl.float32)
    s0 = active * 0
    while s0 < active:
        offs_s = s0 + tl.arange(0, COMBINE_S)
        ok = g_ok[:, None] & (offs_s < active)[None, :]  # [G, S]
        idx = rows[:, None] + offs_s[None, :]
        ms = tl.load(m_ws_ptr + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
        ls = tl.load(l_ws_ptr + idx, mask=ok, other=0.0, cache_modifier=".cg")
        weight = tl.exp2(ms - m_max[:, None])  # [G, S], 0 where masked
        total += tl.sum(ls * weight, 1)
        parts = tl.load(acc_ws_ptr + idx[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                        mask=ok[:, :, None], other=0.0, cache_modifier=".cg")  # fmt: skip
        out += tl.sum(parts * weight[:, :, None], 1)
        s0 += COMBINE_S
    out = out / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + (head0 + offs_g)[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])  # fmt: skip


@triton.jit(do_not_specialize=_PER_STEP_ARGS)
def _paged_attention_tiled_kernel(
    q_ptr,  # [T, Hq, D]
    k_new_ptr,  # [T, Hkv, D] this step's keys (written to the cache here)
    v_new_ptr,
    slot_mapping_ptr,  # [T] int64
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    out_ptr,  # [T, Hq, D]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B]
    query_start_loc_ptr,  # [B + 1]
    num_tokens,
    num_seqs,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_M: tl.constexpr,  # query tokens per tile; BLOCK_M * GROUP_P2 >= 16 dot rows
    HEAD_DIM: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Tiles of sequence b are numbered from first[b] = query_start_loc[b] // BLOCK_M + b, an
    # upper bound on the tiles before b that never lets a tile cross into the next sequence.
    # "Sequence" num_seqs is the padding past query_start_loc[-1] (up to num_tokens): its
    # tiles write the padding tokens' K/V to their scratch slots and a zero output. first[] is
    # strictly increasing, so the owner is the last b <= num_seqs with first[b] <= tile_id.
    lo = tile_id * 0
    hi = lo + num_seqs + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first_mid = tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid
        take = first_mid <= tile_id
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid)
    seq = lo
    is_real = seq < num_seqs
    q_start = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1, mask=is_real, other=num_tokens)
    seq_len = tl.load(seq_lens_ptr + seq, mask=is_real, other=0)
    tile_start = q_start + (tile_id - (q_start // BLOCK_M + seq)) * BLOCK_M
    tile_rows = tl.minimum(q_end - tile_start, BLOCK_M)  # <= 0: a spare program, no work
    # A one-token (decode) sequence belongs to the single-token kernel's BY_SEQ launch: one
    # token in a tile would waste all but GROUP of its dot rows.
    tile_rows = tl.where(is_real & (q_end - q_start == 1), 0, tile_rows)
    context_len = seq_len - (q_end - q_start)  # keys already in the cache before this step
    # Keys up to the tile's last query position; none for padding and spare programs.
    key_hi = context_len + (tile_start - q_start) + tile_rows
    key_hi = tl.where(is_real & (tile_rows > 0), tl.minimum(key_hi, seq_len), 0)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    k_new_ptr += kv_head * stride_kh
    v_new_ptr += kv_head * stride_vh
    head_offset = kv_head * stride_cache_head

    # The KV-cache write, fused: the tile's program stores its tokens' K and V (padding ones
    # into block 0, the runtime's scratch). Nothing of this launch reads them from the cache.
    tokens = tile_start + offs_m
    token_ok = offs_m < tile_rows
    slots = tl.load(slot_mapping_ptr + tokens, mask=token_ok, other=0).to(tl.int64)
    dst = (
        (
            (slots // KV_BLOCK_SIZE) * stride_cache_block
            + (slots % KV_BLOCK_SIZE) * stride_cache_slot
        )[:, None]
        + head_offset
        + offs_d[None, :]
    )
    src = tokens.to(tl.int64)[:, None]
    k_rows = tl.load(k_new_ptr + src * stride_kt + offs_d[None, :], mask=token_ok[:, None])
    v_rows = tl.load(v_new_ptr + src * stride_vt + offs_d[None, :], mask=token_ok[:, None])
    tl.store(k_cache_ptr + dst, k_rows.to(k_cache_ptr.dtype.element_ty), mask=token_ok[:, None])
    tl.store(v_cache_ptr + dst, v_rows.to(v_cache_ptr.dtype.element_ty), mask=token_ok[:, None])

    # Dot rows: row r is query token r // GROUP_P2 of the tile, head r % GROUP_P2 of the group.
    offs_r = tl.arange(0, BLOCK_M * GROUP_P2)
    row_tok = offs_r // GROUP_P2
    row_head = offs_r % GROUP_P2
    heads = kv_head * GROUP + row_head
    row_ok = (row_tok < tile_rows) & (row_head < GROUP)
    row_tokens = (tile_start + row_tok).to(tl.int64)
    q = tl.load(
        q_ptr + row_tokens[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if COMPUTE_F32:
        q = q.to(tl.float32)
    # Query i of the sequence sits at position context_len + i. Rows past the tile's tokens
    # see every key of the tile so their softmax stays finite; they are never stored.
    row_last = context_len + (tile_start - q_start) + row_tok
    row_last = tl.where(row_tok < tile_rows, row_last, key_hi - 1)

    m_i = tl.full([BLOCK_M * GROUP_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_P2], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_P2, HEAD_DIM], tl.float32)
    table_row = block_tables_ptr + tl.minimum(seq, num_seqs - 1).to(tl.int64) * stride_bt
    m_i, l_i, acc = _attend_keys(
        q, m_i, l_i, acc, key_hi * 0, key_hi, row_last, context_len, q_start, table_row,
        k_cache_ptr + head_offset, v_cache_ptr + head_offset, k_new_ptr, v_new_ptr,
        stride_cache_block, stride_cache_slot, stride_kt, stride_vt, qk_scale, k_new_ptr,
        k_new_ptr, 0, True, KV_BLOCK_SIZE, BLOCK_N, HEAD_DIM, COMPUTE_F32, DOT_PRECISION, 0,
        False,
    )  # fmt: skip

    # Padding tokens have no keys: acc and l_i stay 0, so their output is 0.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + row_tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


INTERPRETED = not isinstance(_paged_attention_kernel, JITFunction)
"""True when triton was imported with TRITON_INTERPRET=1: kernels then run on CPU tensors."""


# --------------------------------------------------------------------------- launcher


def choose_num_splits(
    kernel_config: KernelConfig,
    num_tokens: int,
    num_kv_heads: int,
    max_context: int,
    device: torch.device,
) -> int:
    """How many KV splits to use, from shapes only (never tensor values, so the choice is the
    same at capture and replay). 1 means the single-pass kernel. Splitting pays when the
    T * Hkv programs would leave SMs idle and the context is long; max_context is the block
    table's capacity, an upper bound on any sequence's length: at most the config's
    UNSPLIT_KEYS, one split. The kernel gives a short sequence in a wide table fewer splits
    (one below 2 x MIN_SPLIT_KEYS keys), but the rest still launch (`unsplit_context`)."""
    programs = num_tokens * num_kv_heads
    sms = sm_count(device)
    attention = kernel_config.attention
    config = attention.decode(num_tokens, device.type)
    if programs >= sms or max_context <= config.unsplit_keys:
        return 1
    splits = min(
        triton.cdiv(2 * sms, programs),
        triton.cdiv(max_context, config.min_split_keys),
        attention.max_splits,
    )
    return max(splits, 1)


def unsplit_context(
    kernel_config: KernelConfig, num_tokens: int, num_kv_heads: int, device: torch.device
) -> int:
    """The widest block table, in keys, on which a launch of these shapes runs unsplit while
    wider ones split; 0 if there is none (the launch never splits, or always does). A CUDA
    graph captured on a table that narrow skips split-KV's idle programs and combine for
    steps whose contexts fit (compiler/cuda_graphs.py)."""
    keys = kernel_config.attention.decode(num_tokens, device.type).unsplit_keys
    if (
        keys == 0
        or choose_num_splits(kernel_config, num_tokens, num_kv_heads, 1 << 30, device) == 1
    ):
        return 0
    return keys


_MIN_COUNTERS = 4096  # more than any automatic choice needs (T x Hkv below the SM count)


def _split_counters(device: torch.device, size: int) -> Tensor:
    """The fused split reduction's arrival counters, one per (token, KV head)
    (kernels_generated/counters.py)."""
    return arrival_counters(
        "paged_attention", device, max(size, _MIN_COUNTERS), PagedAttentionKernelError
    )


def choose_tiled(kernel_config: KernelConfig, num_tokens: int, num_seqs: int) -> bool:
    """The automatic choice (tiled=None): the tiled variant (with its decode tokens on the
    single-token kernel) when the batch is prefill-heavy by its shapes, at least
    `tiled_min_tokens_per_seq` tokens per sequence slot; the single-token kernel otherwise.
    Never reads tensor values."""
    return num_tokens >= kernel_config.attention.tiled_min_tokens_per_seq * max(num_seqs, 1)


def _validate(q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, block_tables: Tensor) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    two, _, _, num_kv_heads, cache_dim = kv_cache.shape
    if two != 2 or cache_dim != head_dim or k.shape != (num_tokens, num_kv_heads, head_dim):
        raise PagedAttentionKernelError(
            f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"kv_cache {tuple(kv_cache.shape)} (want [2, num_blocks, block_size, Hkv, D])"
        )
    if v.shape != k.shape:
        raise PagedAttentionKernelError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if head_dim < _MIN_DOT_ROWS or head_dim & (head_dim - 1):
        raise PagedAttentionKernelError(
            f"head_dim {head_dim} is not supported: the kernel needs a power of two >= 16 "
            "(64 and 128 in real models); use models.ops.paged_attention_ref instead"
        )
    if num_q_heads % num_kv_heads:
        raise PagedAttentionKernelError(
            f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads"
        )
    if not kv_cache.is_contiguous():
        raise PagedAttentionKernelError("kv_cache must be contiguous (the engine allocates it so)")
    if block_tables.stride(-1) != 1:
        raise PagedAttentionKernelError("block_tables must be contiguous in its last dimension")
    if q.device.type == "cpu" and not INTERPRETED:
        raise PagedAttentionKernelError(
            "the Triton paged-attention kernel runs on CPU tensors only under the interpreter: "
            "set TRITON_INTERPRET=1 before triton is first imported"
        )
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        raise PagedAttentionKernelError(
            "the Triton interpreter computes bfloat16 wrongly; use float32 or float16 on CPU"
        )


def paged_attention_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    tiled: bool | None = None,
    positions: Tensor | None = None,
    cos_sin_cache: Tensor | None = None,
    kernel_config: KernelConfig | None = None,
) -> Tensor:
    """Same contract as `models.ops.paged_attention`: writes k/v into kv_cache through
    slot_mapping, returns attention output [T, Hq, D]. num_splits: None chooses from shapes
    (`choose_num_splits`), 1 forces the single-pass kernel, > 1 forces split-KV. tiled: True
    runs the query-tiled prefill variant (no splits), False the single-token kernel, None
    chooses (`choose_tiled`, only when num_splits is None). With positions [T] and
    cos_sin_cache [max_pos, rot_dim] q and k arrive unrotated and the kernel applies
    `models.ops.rotary` to them as it loads them (`paged_attention_rotary_ref`): the rotated
    keys are what it writes to the cache. kernel_config: launch configs, split policy and PDL
    (None: the defaults)."""
    kernel_config = kernel_config or tuning.default()
    rotary = _rotary_args(q, positions, cos_sin_cache)  # the call's own arguments first
    _validate(q, k, v, kv_cache, block_tables)
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape

    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    # The kernel writes k/v into the cache itself (one launch, no index_copy kernels).
    k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)  # what the cache holds is what is read
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if slot_mapping.dtype != torch.int64:
        slot_mapping = slot_mapping.long()
    if tiled is None:
        tiled = num_splits is None and choose_tiled(
            kernel_config, num_tokens, block_tables.shape[0]
        )
    if tiled:
        if num_splits not in (None, 1):
            raise PagedAttentionKernelError(
                f"the tiled prefill variant does not split KV; got num_splits={num_splits} "
                "(pass tiled=False to split, or num_splits=None)"
            )
        if rotary is not None:
            # Prefill-heavy batches rotate first (the rotary kernel, one launch for q and k):
            # the tiled kernel's [64, D] query tiles rotated in registers would spill.
            positions, cos_sin_cache = rotary
            q, k = rotary_triton(positions, q, k, cos_sin_cache, kernel_config=kernel_config)
            rotary = None
        args = (q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc)
        _launch_tiled(*args, scale, out, kernel_config)
        # The decode tokens of the batch, one program per sequence (the tiled kernel skips
        # one-token sequences: a lone token in a 32-token tile wastes the dot's rows; measured
        # on the H200, 540 us a layer for 1,811 prefill + 237 decode tokens, of which the
        # prefill alone took 77 us). The two launches touch disjoint tokens.
        _launch_single(*args, scale, out, kernel_config, num_splits=1, by_seq=True, rotary=rotary)
        return out
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(
            kernel_config, num_tokens, num_kv_heads, max_context, q.device
        )
    if num_splits < 1:
        raise PagedAttentionKernelError(f"num_splits must be >= 1, got {num_splits}")
    _launch_single(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                   scale, out, kernel_config, num_splits=num_splits, by_seq=False,
                   rotary=rotary)  # fmt: skip
    return out


def _rotary_args(
    q: Tensor, positions: Tensor | None, cos_sin_cache: Tensor | None
) -> tuple[Tensor, Tensor] | None:
    """The (positions, cos_sin_cache) the kernels rotate q and k with, checked; None for none."""
    if positions is None and cos_sin_cache is None:
        return None
    if positions is None or cos_sin_cache is None:
        raise PagedAttentionKernelError("rotary needs both positions and cos_sin_cache")
    num_tokens, _, head_dim = q.shape
    if positions.shape != (num_tokens,) or positions.dtype.is_floating_point:
        raise PagedAttentionKernelError(
            f"positions must be integers of shape [{num_tokens}], got {positions.dtype} "
            f"{tuple(positions.shape)}"
        )
    rot_dim = cos_sin_cache.shape[-1] if cos_sin_cache.dim() == 2 else -1
    if rot_dim <= 0 or rot_dim % 2 or rot_dim > head_dim or cos_sin_cache.stride(-1) != 1:
        raise PagedAttentionKernelError(
            f"cos_sin_cache must be [max_pos, rot_dim] with an even rot_dim <= head_dim "
            f"{head_dim}, contiguous in its last dimension; got {tuple(cos_sin_cache.shape)}"
        )
    return positions, cos_sin_cache


def _rotary_launch_args(rotary: tuple[Tensor, Tensor] | None, dummy: Tensor) -> tuple:
    """(positions_ptr, cos_sin_ptr, stride_cs) and the constexprs {ROT_DIM, ROTARY} of a
    launch; without rotary, `dummy` stands for the pointers the kernel never reads."""
    if rotary is None:
        return (dummy, dummy, 0), {"ROT_DIM": 0, "ROTARY": False}
    positions, table = rotary
    return (positions, table, table.stride(0)), {"ROT_DIM": table.shape[-1], "ROTARY": True}


def _strides(
    q: Tensor, out: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, block_tables: Tensor
) -> tuple[int, ...]:
    """The stride arguments both kernels take, in their order (stride_qt ... stride_bt)."""
    return (
        *q.stride()[:2], *out.stride()[:2], *k.stride()[:2], *v.stride()[:2],
        *k_cache.stride()[:3], block_tables.stride(0),
    )  # fmt: skip


def _launch_single(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    out: Tensor,
    kernel_config: KernelConfig,
    *,
    num_splits: int,
    by_seq: bool,
    rotary: tuple[Tensor, Tensor] | None = None,
) -> None:
    """Launch `_paged_attention_kernel` (inputs already validated and converted): a program
    per token (by_seq False) or, beside the tiled kernel, per one-token sequence (by_seq)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    on_cpu = q.device.type == "cpu"
    config = kernel_config.attention.decode(num_tokens, q.device.type)
    group = num_q_heads // num_kv_heads
    block_g = max(_MIN_DOT_ROWS, triton.next_power_of_2(group))
    # float32 inputs keep full precision on GPU (tf32 would lose ~3 digits); bf16/fp16 take
    # the tensor-core path, where the precision flag has no effect.
    dot_precision = "ieee" if q.dtype == torch.float32 or on_cpu else "tf32"
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (block_tables.shape[0] if by_seq else num_tokens, num_kv_heads, num_splits)

    if num_splits > 1:
        m_ws = torch.empty(
            (num_tokens, num_q_heads, num_splits), dtype=torch.float32, device=q.device
        )
        l_ws = torch.empty_like(m_ws)
        acc_ws = torch.empty(
            (num_tokens, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        counters = _split_counters(q.device, grid[0] * grid[1])
    else:
        m_ws = l_ws = acc_ws = counters = out  # never touched by the single-pass kernel
    rotary_ptrs, rotary_consts = _rotary_launch_args(rotary, slot_mapping)
    pdl = pdl_on(kernel_config, q.device, num_tokens)

    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _paged_attention_kernel[grid](
            q,
            k,
            v,
            slot_mapping,
            k_cache,
            v_cache,
            out,
            m_ws,
            l_ws,
            acc_ws,
            counters,
            block_tables,
            seq_lens,
            query_start_loc,
            block_tables.shape[0],
            num_q_heads,
            scale * _LOG2E,
            *_strides(q, out, k, v, k_cache, block_tables),
            *rotary_ptrs,
            GROUP=group,
            BLOCK_G=block_g,
            HEAD_DIM=head_dim,
            KV_BLOCK_SIZE=block_size,
            BLOCK_N=config.block_n,
            NUM_SPLITS=num_splits,
            MIN_SPLIT_KEYS=config.min_split_keys,
            COMBINE_G=triton.next_power_of_2(group),
            COMBINE_S=min(
                kernel_config.attention.combine_splits, triton.next_power_of_2(num_splits)
            ),
            COMPUTE_F32=on_cpu,
            DOT_PRECISION=dot_precision,
            BY_SEQ=by_seq,
            **rotary_consts,
            # With FMA contraction the H200 skipped the rotation's rounding steps (51,248 of
            # 256 x 8 x 128 keys off by an ulp at batch 256); without it, bit-exact.
            enable_fp_fusion=rotary is None,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            # A register cap, where a config sets one: more programs resident an SM.
            **({"maxnreg": config.maxnreg} if config.maxnreg is not None else {}),
            PDL=pdl,
            **pdl_launch(pdl),
        )


def _launch_tiled(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    out: Tensor,
    kernel_config: KernelConfig,
) -> None:
    """Launch `_paged_attention_tiled_kernel` (inputs already validated and converted)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    num_seqs = block_tables.shape[0]
    on_cpu = q.device.type == "cpu"
    config = kernel_config.attention.tiled(q.device.type)
    group = num_q_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    # ROWS >= 16 and a power of two, so the dot has >= 16 rows; a group wider than ROWS
    # takes one token a tile.
    block_m = max(config.rows // group_p2, 1)
    dot_precision = "ieee" if q.dtype == torch.float32 or on_cpu else "tf32"
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    # An upper bound on the tiles from shapes only: sequence b's tiles start at
    # query_start_loc[b] // BLOCK_M + b, and the padding past query_start_loc[-1] is one more
    # "sequence". Programs past the last tile find no rows and store nothing.
    grid = (num_tokens // block_m + num_seqs + 1, num_kv_heads)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _paged_attention_tiled_kernel[grid](
            q,
            k,
            v,
            slot_mapping,
            k_cache,
            v_cache,
            out,
            block_tables,
            seq_lens,
            query_start_loc,
            num_tokens,
            num_seqs,
            scale * _LOG2E,
            *_strides(q, out, k, v, k_cache, block_tables),
            GROUP=group,
            GROUP_P2=group_p2,
            BLOCK_M=block_m,
            HEAD_DIM=head_dim,
            KV_BLOCK_SIZE=block_size,
            BLOCK_N=config.block_n,
            COMPUTE_F32=on_cpu,
            DOT_PRECISION=dot_precision,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )


# The op the paged-attention pass swaps in for ce::paged_attention: its schema and the kernel
# config's key (tuning.py), opaque to Dynamo and Inductor (torch.library.triton_op fails under
# torch.compile on CPU).
@torch.library.custom_op("ce_kernels::paged_attention", mutates_args=("kv_cache",))
def paged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    tuning_key: str,
) -> Tensor:
    """`ce::paged_attention` computed by the Triton kernel (split-KV chosen from shapes)."""
    return paged_attention_triton(
        q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
        kernel_config=tuning.resolve(tuning_key),
    )  # fmt: skip


@paged_attention.register_fake
def _paged_attention_kernel_fake(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    tuning_key: str,
) -> Tensor:
    return paged_attention_fake(
        q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale
    )


def paged_attention_rotary_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    positions: Tensor,
    cos_sin_cache: Tensor,
) -> Tensor:
    """What `ce_kernels::paged_attention_rotary` computes: `ce::rotary`, then attention."""
    q, k = rotary_ref(positions, q, k, cos_sin_cache)
    return paged_attention_ref(
        q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale
    )


# The op the rotary_into_attention pass puts in place of ce::rotary + ce::paged_attention.
@torch.library.custom_op("ce_kernels::paged_attention_rotary", mutates_args=("kv_cache",))
def paged_attention_rotary(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    positions: Tensor,
    cos_sin_cache: Tensor,
    tuning_key: str,
) -> Tensor:
    """`ce::paged_attention` of the rotated q and k (`ce::rotary`), the rotation done by the
    Triton kernel as it loads them: no rotary kernel, no rotated copies of q and k."""
    return paged_attention_triton(
        q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
        positions=positions, cos_sin_cache=cos_sin_cache,
        kernel_config=tuning.resolve(tuning_key),
    )  # fmt: skip


@paged_attention_rotary.register_fake
def _paged_attention_rotary_fake(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    positions: Tensor,
    cos_sin_cache: Tensor,
    tuning_key: str,
) -> Tensor:
    return torch.empty_like(q)


# --------------------------------------------------------------------------- inputs, check, bench


@dataclass(slots=True)
class PagedBatch:
    """One packed step's inputs, laid out the way the runtime builds them."""

    q: Tensor
    k: Tensor
    v: Tensor
    kv_cache: Tensor
    slot_mapping: Tensor
    block_tables: Tensor
    seq_lens: Tensor
    query_start_loc: Tensor
    scale: float

    def args(self, kv_cache: Tensor | None = None) -> tuple:
        cache = self.kv_cache if kv_cache is None else kv_cache
        return (
            self.q,
            self.k,
            self.v,
            cache,
            self.slot_mapping,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
        )

    def kv_bytes_read(self) -> int:
        """K and V bytes attention reads: every sequence's whole context, once per KV head
        (host-side sum of seq_lens: for reporting, never on the launch path)."""
        _, _, _, num_kv_heads, head_dim = self.kv_cache.shape
        tokens = int(self.seq_lens.sum())
        return 2 * tokens * num_kv_heads * head_dim * self.kv_cache.element_size()


@dataclass(slots=True)
class PagedLayout:
    """Where a test batch's tokens live in a paged cache, laid out as the runtime does."""

    slot_mapping: Tensor  # [T] int64
    block_tables: Tensor  # [B, width] int32
    seq_lens: Tensor  # [B] int32
    query_start_loc: Tensor  # [B + 1] int32
    num_tokens: int  # T, padding included
    num_blocks: int  # the cache's blocks, scratch block 0 included


def paged_layout(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    block_size: int,
    device: str | torch.device = "cpu",
    pad_tokens: int = 0,
    pad_seqs: int = 0,
    table_width: int | None = None,
    num_blocks: int | None = None,
    seed: int = 0,
) -> PagedLayout:
    """Block tables, slots and query starts for sequences with the given new-token counts and
    context lengths (seq_len includes the new tokens). Blocks are handed out in a scrambled
    order starting at 1 (block 0 is the scratch block padding writes into). pad_tokens are
    appended past query_start_loc[-1] with slots in block 0; pad_seqs are appended with q_len
    0, seq_len 0. table_width and num_blocks (defaults: just enough) fix shapes, as the
    runner's captured buffers do. Shared by the paged and the MLA latent kernels' tests."""
    if len(q_lens) != len(seq_lens) or any(q > s for q, s in zip(q_lens, seq_lens, strict=True)):
        raise ValueError("need one seq_len >= q_len per sequence")
    rng = random.Random(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    needed = 1 + sum(blocks_per_seq)
    num_blocks = needed if num_blocks is None else num_blocks
    width = max([*blocks_per_seq, 1]) if table_width is None else table_width
    if num_blocks < needed or width < max([*blocks_per_seq, 1]):
        raise ValueError(f"need {needed} blocks and a table width of {max(blocks_per_seq)}")
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = torch.zeros(len(q_lens) + pad_seqs, width, dtype=torch.int32)
    slots: list[int] = []
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        table = [free.pop() for _ in range(blocks_per_seq[b])]
        tables[b, : len(table)] = torch.tensor(table, dtype=torch.int32)
        for pos in range(seq_len - q_len, seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    slots += [i % block_size for i in range(pad_tokens)]  # block 0, the scratch block
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    starts += [starts[-1]] * pad_seqs
    return PagedLayout(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor([*seq_lens, *[0] * pad_seqs], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        num_tokens=starts[-1] + pad_tokens,
        num_blocks=num_blocks,
    )


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    pad_tokens: int = 0,
    pad_seqs: int = 0,
    table_width: int | None = None,
    num_blocks: int | None = None,
    seed: int = 0,
) -> PagedBatch:
    """Random q/k/v and cache for sequences laid out by `paged_layout` (same arguments)."""
    layout = paged_layout(
        q_lens, seq_lens, block_size=block_size, device=device, pad_tokens=pad_tokens,
        pad_seqs=pad_seqs, table_width=table_width, num_blocks=num_blocks, seed=seed,
    )  # fmt: skip
    num_tokens = layout.num_tokens

    # Drawn on the device: a 30 GB cache drawn on the host would take minutes.
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    cache_shape = (2, layout.num_blocks, block_size, num_kv_heads, head_dim)
    return PagedBatch(
        q=randn(num_tokens, num_q_heads, head_dim),
        k=randn(num_tokens, num_kv_heads, head_dim),
        v=randn(num_tokens, num_kv_heads, head_dim),
        kv_cache=randn(*cache_shape),
        slot_mapping=layout.slot_mapping,
        block_tables=layout.block_tables,
        seq_lens=layout.seq_lens,
        query_start_loc=layout.query_start_loc,
        scale=1.0 / math.sqrt(head_dim),
    )


def rotary_inputs(batch: PagedBatch, rot_dim: int) -> tuple[Tensor, ...]:
    """(q, k, v, positions, cos_sin_cache) for the rotary variant: q, k and v as views of one
    packed [T, (Hq + 2 Hkv) D] tensor, as the model's QKV projection leaves them, each
    token's position in its sequence (padding tokens 0), and a neox cos/sin table of width
    rot_dim (base 10000) covering the longest sequence."""
    num_tokens, num_q_heads, head_dim = batch.q.shape
    num_kv_heads = batch.k.shape[1]
    qkv = torch.cat([batch.q.flatten(1), batch.k.flatten(1), batch.v.flatten(1)], dim=1)
    q, k, v = qkv.split(
        [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1
    )
    starts, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    positions = torch.zeros(num_tokens, dtype=torch.int64)
    for b, seq_len in enumerate(lens):
        start, end = starts[b], starts[b + 1]
        positions[start:end] = torch.arange(seq_len - (end - start), seq_len)
    table = cos_sin_table({"rope_theta": 10000.0}, rot_dim, max(lens, default=1) + 1)
    device = batch.q.device
    return (
        q.view(num_tokens, num_q_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
        positions.to(device),
        table.to(device),
    )


def check(
    batch: PagedBatch,
    *,
    num_splits: int | None = None,
    atol: float | None = None,
    tiled: bool | None = None,
    rot_dim: int | None = None,
) -> dict[str, float]:
    """Run the kernel and the reference on copies of the cache; raise AssertionError if the
    outputs or the written caches differ. Returns max abs error and cosine similarity. With
    rot_dim, q and k arrive unrotated (`rotary_inputs`) and the kernel rotates them, against
    `paged_attention_rotary_ref`."""
    cache_ref, cache_out = batch.kv_cache.clone(), batch.kv_cache.clone()
    if rot_dim is None:
        expected = paged_attention_ref(*batch.args(cache_ref))
        got = paged_attention_triton(*batch.args(cache_out), num_splits=num_splits, tiled=tiled)
    else:
        q, k, v, positions, table = rotary_inputs(batch, rot_dim)
        rest = batch.args()[4:]  # slot_mapping ... scale
        expected = paged_attention_rotary_ref(q, k, v, cache_ref, *rest, positions, table)
        got = paged_attention_triton(
            q, k, v, cache_out, *rest, num_splits=num_splits, tiled=tiled, positions=positions,
            cos_sin_cache=table,
        )  # fmt: skip
    return compare_outputs(got, expected, (cache_out, cache_ref), "kv_cache", atol)


def compare_outputs(
    got: Tensor,
    expected: Tensor,
    caches: tuple[Tensor, Tensor],
    cache_name: str,
    atol: float | None = None,
) -> dict[str, float]:
    """An attention kernel's output and written cache against the reference's: max abs error
    and cosine similarity; AssertionError where the caches (kernel's, reference's) differ at
    all or the error passes atol (by default 1e-4 in float32, 2e-3 in float16, else 2e-2)."""
    if atol is None:
        atol = {torch.float32: 1e-4, torch.float16: 2e-3}.get(expected.dtype, 2e-2)
    err = (got.float() - expected.float()).abs().max().item() if got.numel() else 0.0
    cos = torch.nn.functional.cosine_similarity(
        got.float().flatten(), expected.float().flatten(), dim=0
    ).item()
    if not torch.equal(*caches):
        raise AssertionError(f"{cache_name} after the kernel differs from the reference's")
    if err > atol:
        raise AssertionError(f"max abs error {err:.3g} > atol {atol:.3g} (cosine {cos:.6f})")
    return {"max_abs_err": err, "cosine": cos}


def bench(
    batch: PagedBatch,
    *,
    fn=None,
    warmup: int = 3,
    iters: int = 20,
    inner: int = 10,
    cuda_graph: bool = False,
) -> dict[str, float]:
    """Time `fn(*batch.args())` (default: the Triton kernel) on CUDA: the median over `iters`
    samples of `inner` back-to-back calls between two CUDA events, and the achieved bandwidth
    (K/V bytes read + q and out bytes) / time. cuda_graph=True captures one call and replays
    it, as the engine runs decode: eager timing of a small batch measures Python launch
    overhead, not the kernel. Repeated calls find a context smaller than L2 (60 MB on the
    H200) cached there."""
    fn = paged_attention_triton if fn is None else fn
    call = functools.partial(fn, *batch.args())
    seconds = event_seconds(call, cuda_graph=cuda_graph, warmup=warmup, iters=iters, inner=inner)
    moved = batch.kv_bytes_read() + 2 * batch.q.numel() * batch.q.element_size()
    return {"seconds": seconds, "gb_s": moved / seconds / 1e9}
