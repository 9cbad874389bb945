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
  (on CUDA, launches of 1-16 tokens), and a sequence that short takes one split in a wider
  table too (the same arithmetic as unsplit): the runner replays a graph captured on a table that
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
after loading.

Measured on the H200 at 9488c66 (`compile-engine bench paged-attention --contexts 100 640
4096 32768`, bf16 decode, Hq 32, Hkv 8, D 128, block 16, one context for every sequence,
CUDA-graph replay; paged_attention-nvidia-h200-9488c66.json): batch 256 reads 101-103% of the
4.26 TB/s copy rate at contexts 4k / 32k (1.00 / 7.87 ms a layer), 92% at 640 (0.172 ms), 53%
at 100 (0.048 ms: per-program fixed cost, not bandwidth); batch 64 91-95% at 4k / 32k;
batch 1 takes 8 us at context 100 and reads 64% at 32k (33 splits, 49 us). 3.3-4.1x the
reference gather + SDPA from 4k up. The configs chosen after that run (tuning.py) were
faster or equal at every shape of the sweep.

This module holds the kernels only. The package's launch.py validates inputs, makes the
shape-only choices (splits, the tiled variant) and launches; ops.py registers the custom ops
the passes emit. Inputs, `check()` and `bench()` are harness code, in
benchmarks/attention_inputs.py and benchmarks/paged_attention.py.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction


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
def _round_to_e4m3(x):
    """x (float32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, in float32
    arithmetic: the Triton interpreter's float32 -> float8 cast rounds values just below a
    power of two down a binade (126.6 -> 64; measured on triton 3.7.1), exact ones it casts
    right. The step is 2^(exponent - 3) over e4m3's normal range, 2^-9 below it (subnormal);
    adding and taking away 1.5 * 2^23 rounds x / step to an integer, ties to even."""
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    return ((x / step + 12582912.0) - 12582912.0) * step


@triton.jit
def _to_cache(x, scale, cache_ptr, FP8_KV: tl.constexpr, COMPUTE_F32: tl.constexpr):
    """K or V rows as the cache at cache_ptr stores them (`models.ops.quantize_kv`): FP8 e4m3
    of x / scale saturated at 448 (scale a float32 scalar), else x in the cache's dtype."""
    if FP8_KV:
        y = tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), scale), -448.0), 448.0)
        if COMPUTE_F32:
            y = _round_to_e4m3(y)
        return y.to(cache_ptr.dtype.element_ty)
    return x.to(cache_ptr.dtype.element_ty)


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
    k_scale,  # an FP8 cache's scales (FP8_KV only): this step's keys are quantized by them
    v_scale,
    FROM_CACHE: tl.constexpr,
    CAUSAL: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROT_DIM: tl.constexpr,
    ROTARY: tl.constexpr,
    FP8_KV: tl.constexpr,
):
    """One online-softmax step over keys start .. start + BLOCK_N (those below hi). K and V
    come from the cache through the block table (FROM_CACHE: keys before context_len, which
    earlier steps wrote) or from the k/v inputs, row new_row0 + pos - context_len (this step's
    keys: the programs that write them to the cache run in this same launch). With FP8_KV
    both come in the cache's units (values / scale, rounded to e4m3 as the cache write rounds
    them, this step's keys too): the caller folds k_scale into qk_scale and v_scale into the
    output."""
    pos = start + tl.arange(0, BLOCK_N)
    valid = pos < hi
    offs_d = tl.arange(0, HEAD_DIM)[None, :]
    if FROM_CACHE:
        block = tl.load(table_row + pos // KV_BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        row = block * stride_cache_block + (pos % KV_BLOCK_SIZE) * stride_cache_slot
        k = tl.load(k_cache_ptr + row[:, None] + offs_d, mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + row[:, None] + offs_d, mask=valid[:, None], other=0.0)
        if FP8_KV:  # e4m3 values are exact in bf16 / fp16: the dot runs in q's dtype
            k = k.to(q.dtype)
            v = v.to(q.dtype)
    else:
        rows = (new_row0 + pos - context_len).to(tl.int64)
        key_pos = rows  # unused without ROTARY
        if ROTARY:
            key_pos = tl.load(positions_ptr + rows, mask=valid, other=0)
        k = _load_rotated(k_new_ptr + rows[:, None] * stride_kt, offs_d, key_pos[:, None],
                          valid[:, None], cos_sin_ptr, stride_cs, ROT_DIM, ROTARY)  # fmt: skip
        v = tl.load(v_new_ptr + rows[:, None] * stride_vt + offs_d, mask=valid[:, None], other=0.0)
        if FP8_KV:  # what the cache will hold, so that every key is read alike
            k = _to_cache(k, k_scale, k_cache_ptr, FP8_KV, COMPUTE_F32).to(q.dtype)
            v = _to_cache(v, v_scale, v_cache_ptr, FP8_KV, COMPUTE_F32).to(q.dtype)
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
    k_scale,
    v_scale,
    FROM_CACHE: tl.constexpr,
    CAUSAL: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROT_DIM: tl.constexpr,
    ROTARY: tl.constexpr,
    FP8_KV: tl.constexpr,
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
                stride_cs, k_scale, v_scale, FROM_CACHE, CAUSAL, KV_BLOCK_SIZE, BLOCK_N,
                HEAD_DIM, COMPUTE_F32, DOT_PRECISION, ROT_DIM, ROTARY, FP8_KV,
            )  # fmt: skip
            start += BLOCK_N
    else:
        # GPU: a for loop, which Triton software-pipelines over num_stages (a while loop not).
        for start in tl.range(lo, hi, BLOCK_N, num_stages=LOOP_STAGES):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, start, hi, row_last, context_len, new_row0, table_row,
                k_cache_ptr, v_cache_ptr, k_new_ptr, v_new_ptr, stride_cache_block,
                stride_cache_slot, stride_kt, stride_vt, qk_scale, positions_ptr, cos_sin_ptr,
                stride_cs, k_scale, v_scale, FROM_CACHE, CAUSAL, KV_BLOCK_SIZE, BLOCK_N,
                HEAD_DIM, COMPUTE_F32, DOT_PRECISION, ROT_DIM, ROTARY, FP8_KV,
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
    k_scale,
    v_scale,
    CAUSAL: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROT_DIM: tl.constexpr,
    ROTARY: tl.constexpr,
    FP8_KV: tl.constexpr,
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
        stride_kt, stride_vt, qk_scale, positions_ptr, cos_sin_ptr, stride_cs, k_scale, v_scale,
        True, CAUSAL, KV_BLOCK_SIZE, BLOCK_N, HEAD_DIM, COMPUTE_F32, DOT_PRECISION, ROT_DIM,
        ROTARY, FP8_KV,
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
        stride_kt, stride_vt, qk_scale, positions_ptr, cos_sin_ptr, stride_cs, k_scale, v_scale,
        False, CAUSAL, KV_BLOCK_SIZE, 16 if ROTATED_TILES else BLOCK_N, HEAD_DIM, COMPUTE_F32,
        DOT_PRECISION, ROT_DIM, ROTARY, FP8_KV, 1 if ROTATED_TILES else None,
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
    k_scale_ptr,  # [] float32 an FP8 cache's scales (FP8_KV only)
    v_scale_ptr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP padded to tl.dot's minimum
    HEAD_DIM: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,  # 1: one pass; > 1: up to NUM_SPLITS programs share the keys
    MIN_SPLIT_KEYS: tl.constexpr,  # a split takes at least this many keys
    UNSPLIT_KEYS: tl.constexpr,  # a sequence of at most this many keys takes one split (0: none)
    COMBINE_G: tl.constexpr,  # GROUP rounded up to a power of two (the combine's rows)
    COMBINE_S: tl.constexpr,  # splits the combine loads at once (a power of two)
    COMPUTE_F32: tl.constexpr,  # interpreter: cast tiles to float32 after loading
    DOT_PRECISION: tl.constexpr,
    BY_SEQ: tl.constexpr = False,  # grid over sequences; only one-token sequences work
    ROT_DIM: tl.constexpr = 0,  # the rotary's width (ROTARY only)
    ROTARY: tl.constexpr = False,  # q and k arrive unrotated: rotate them here
    FP8_KV: tl.constexpr = False,  # the cache is float8_e4m3fn, scaled by k/v_scale_ptr
    PDL: tl.constexpr = False,  # a PDL dependent: waits for the kernel ahead, releases the next
    # after the key loops (tuning.py)
    WRITE_ONLY: tl.constexpr = False,  # store the tokens' K/V in the cache and return (one split)
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
        if UNSPLIT_KEYS > 0:
            # As a table of UNSPLIT_KEYS keys runs unsplit, so does a sequence that short in
            # a wider one: a token's output does not depend on which graph's table it got.
            per_split = tl.where(num_keys <= UNSPLIT_KEYS, tl.maximum(num_keys, 1), per_split)
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
    k_scale = 1.0
    v_scale = 1.0
    if FP8_KV:
        # Keys and values are read in the cache's units: k_scale goes into the scores' scale,
        # v_scale onto the output (one multiply each, not one a loaded element).
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
        qk_scale = qk_scale * k_scale

    # The token's own K and V: key num_keys - 1 is the token itself (row `token` of k/v).
    token_pos = token  # unused without ROTARY
    if ROTARY:
        token_pos = tl.load(positions_ptr + token, mask=mine, other=0)
    k_row = _load_rotated(k_new_ptr + token.to(tl.int64) * stride_kt, offs_d, token_pos, mine,
                          cos_sin_ptr, stride_cs, ROT_DIM, ROTARY)  # fmt: skip
    v_row = tl.load(v_new_ptr + token.to(tl.int64) * stride_vt + offs_d, mask=mine, other=0.0)
    k_store = _to_cache(k_row, k_scale, k_cache_ptr, FP8_KV, COMPUTE_F32)
    v_store = _to_cache(v_row, v_scale, v_cache_ptr, FP8_KV, COMPUTE_F32)
    if FP8_KV:  # the token's own key as the cache holds it, like every other key it sees
        k_row = k_store.to(k_row.dtype)
        v_row = v_store.to(v_row.dtype)
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
        tl.store(k_cache_ptr + dst, k_store, mask=mine)
        tl.store(v_cache_ptr + dst, v_store, mask=mine)
    if WRITE_ONLY:
        return

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
        stride_cs, k_scale, v_scale, False, KV_BLOCK_SIZE, BLOCK_N, HEAD_DIM, COMPUTE_F32,
        DOT_PRECISION, ROT_DIM, ROTARY, FP8_KV,
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
    if FP8_KV:
        acc = acc * v_scale  # linear in acc: a split's partial takes it as the output does

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
    m_ws_ptr,  # [T, Hq, S] float32, split only
    l_ws_ptr,  # [T, Hq, S] float32, split only
    acc_ws_ptr,  # [T, Hq, S, D] float32, split only
    counters_ptr,  # [>= tiles * Hkv] int32, zero between launches; split only
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B]
    query_start_loc_ptr,  # [B + 1]
    num_tokens,
    num_seqs,
    num_q_heads,
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
    k_scale_ptr,  # [] float32 an FP8 cache's scales (FP8_KV only)
    v_scale_ptr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_M: tl.constexpr,  # query tokens per tile; BLOCK_M * GROUP_P2 >= 16 dot rows
    HEAD_DIM: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8_KV: tl.constexpr = False,  # the cache is float8_e4m3fn, scaled by k/v_scale_ptr
    NUM_SPLITS: tl.constexpr = 1,  # > 1: up to NUM_SPLITS programs share a tile's cached keys
    MIN_SPLIT_KEYS: tl.constexpr = 1,  # a split takes at least this many cached keys
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = 0
    if NUM_SPLITS > 1:
        split = tl.program_id(2)

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
    k_scale = 1.0
    v_scale = 1.0
    if FP8_KV:  # read in the cache's units, as in _paged_attention_kernel
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
        qk_scale = qk_scale * k_scale

    # The KV-cache write, fused: the tile's program stores its tokens' K and V (padding ones
    # into block 0, the runtime's scratch). Nothing of this launch reads them from the cache.
    tokens = tile_start + offs_m
    token_ok = (offs_m < tile_rows) & (split == 0)  # the first split's program writes
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
    k_rows = _to_cache(k_rows, k_scale, k_cache_ptr, FP8_KV, COMPUTE_F32)
    v_rows = _to_cache(v_rows, v_scale, v_cache_ptr, FP8_KV, COMPUTE_F32)
    tl.store(k_cache_ptr + dst, k_rows, mask=token_ok[:, None])
    tl.store(v_cache_ptr + dst, v_rows, mask=token_ok[:, None])

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
    # Split s takes a share of the cached keys (those every row of the tile sees, so each
    # split's first key step finds a key for every row and its softmax stays finite); the last
    # active split also takes this step's keys, causally. A tile with no cached keys (a first
    # chunk) has one active split. NUM_SPLITS 1: one program takes every key.
    key_lo = key_hi * 0
    active = 1
    if NUM_SPLITS > 1:
        cached = tl.minimum(context_len, key_hi)
        per_split = tl.maximum(tl.cdiv(cached, NUM_SPLITS), MIN_SPLIT_KEYS)
        per_split = tl.cdiv(per_split, BLOCK_N) * BLOCK_N
        active = tl.maximum(tl.cdiv(cached, per_split), 1)
        key_lo = split * per_split
        split_hi = tl.where(split == active - 1, key_hi, tl.minimum(key_lo + per_split, cached))
        key_hi = tl.where(split < active, split_hi, key_lo)
    m_i, l_i, acc = _attend_keys(
        q, m_i, l_i, acc, key_lo, key_hi, row_last, context_len, q_start, table_row,
        k_cache_ptr + head_offset, v_cache_ptr + head_offset, k_new_ptr, v_new_ptr,
        stride_cache_block, stride_cache_slot, stride_kt, stride_vt, qk_scale, k_new_ptr,
        k_new_ptr, 0, k_scale, v_scale, True, KV_BLOCK_SIZE, BLOCK_N, HEAD_DIM, COMPUTE_F32,
        DOT_PRECISION, 0, False, FP8_KV,
    )  # fmt: skip

    if FP8_KV:
        acc = acc * v_scale  # linear in acc: a split's partial takes it as the output does
    out_ptrs = (
        out_ptr + row_tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    )
    if NUM_SPLITS == 1:
        # Padding tokens have no keys: acc and l_i stay 0, so their output is 0.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    elif active <= 1:
        # Compiled only with splits (the workspace pointers are the output's without them).
        if split == 0:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    elif split < active:
        # As in _paged_attention_kernel: each split stores its partial, the last of the tile's
        # active splits to finish merges them (one launch, no reduce kernel).
        ws_rows = (row_tokens * num_q_heads + heads) * NUM_SPLITS  # [ROWS] each row's split 0
        tl.store(m_ws_ptr + ws_rows + split, m_i, mask=row_ok)
        tl.store(l_ws_ptr + ws_rows + split, l_i, mask=row_ok)
        tl.store(acc_ws_ptr + (ws_rows + split)[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_ok[:, None])  # fmt: skip
        tl.debug_barrier()
        counter = counters_ptr + tile_id * tl.num_programs(1) + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel") == active - 1:
            out = _merge_tile_splits(m_ws_ptr, l_ws_ptr, acc_ws_ptr, ws_rows, row_ok, active,
                                     NUM_SPLITS, HEAD_DIM)  # fmt: skip
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
            tl.atomic_xchg(counter, 0)  # zero again for the next launch


@triton.jit
def _merge_tile_splits(
    m_ws_ptr,  # [T, Hq, S]
    l_ws_ptr,
    acc_ws_ptr,  # [T, Hq, S, D]
    ws_rows,  # [ROWS] each dot row's split 0 in the workspace
    row_ok,
    active,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """The tile's output rows from its splits 0 .. active - 1, an online softmax over the
    partials (every real row saw a key in each split, so each partial's max is finite). Loads
    bypass L1 (.cg): other SMs wrote the partials during this launch."""
    offs_d = tl.arange(0, HEAD_DIM)
    m_all = tl.load(m_ws_ptr + ws_rows, mask=row_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    l_all = tl.load(l_ws_ptr + ws_rows, mask=row_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    out = tl.load(acc_ws_ptr + ws_rows[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=row_ok[:, None], other=0.0, cache_modifier=".cg")  # fmt: skip
    s = active * 0 + 1
    while s < active:  # a while loop: the interpreter refuses a range over a loaded bound
        m_s = tl.load(m_ws_ptr + ws_rows + s, mask=row_ok, other=0.0, cache_modifier=".cg")
        l_s = tl.load(l_ws_ptr + ws_rows + s, mask=row_ok, other=0.0, cache_modifier=".cg")
        acc_s = tl.load(acc_ws_ptr + (ws_rows + s)[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=row_ok[:, None], other=0.0, cache_modifier=".cg")  # fmt: skip
        m_new = tl.maximum(m_all, m_s)
        a_old = tl.exp2(m_all - m_new)
        a_new = tl.exp2(m_s - m_new)
        l_all = l_all * a_old + l_s * a_new
        out = out * a_old[:, None] + acc_s * a_new[:, None]
        m_all = m_new
        s += 1
    return out / tl.where(l_all > 0, l_all, 1.0)[:, None]


INTERPRETED = not isinstance(_paged_attention_kernel, JITFunction)
"""True when triton was imported with TRITON_INTERPRET=1: kernels then run on CPU tensors."""
