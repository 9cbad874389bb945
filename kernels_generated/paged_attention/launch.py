"""Paged attention's launches: input checks, the shape-only choices and the kernel calls.

`paged_attention_triton` is the entry point (the custom ops of ops.py call it): it checks the
inputs, picks the variant from shapes only (`choose_tiled`, `choose_num_splits`), so that a
CUDA graph captured at one step replays correctly at another, and launches the kernels of
kernels.py. The split policy, the launch configs and PDL come from the kernel config
(kernels_generated/tuning.py), passed in.

The helpers up to `split_workspace` are the launch code every split-KV attention kernel of
ours shares (MLA's, kernels_generated/mla_attention/launch.py, too): the split count, the
device checks, the launch's device and dot precision, the partials' workspace.
"""

from __future__ import annotations

import contextlib

import torch
import triton
from torch import Tensor

from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.counters import arrival_counters
from compile_engine.kernels_generated.device import pdl_launch, pdl_on, sm_count
from compile_engine.kernels_generated.paged_attention.kernels import (
    INTERPRETED,
    _paged_attention_kernel,
    _paged_attention_tiled_kernel,
)
from compile_engine.kernels_generated.rotary import rotary_triton
from compile_engine.kernels_generated.tuning import KernelConfig
from compile_engine.models.ops import KV_FP8_DTYPE

LOG2E = 1.4426950408889634  # the kernels' softmax is in base 2: scores scaled by log2(e)
MIN_DOT = 16  # tl.dot needs M, N, K >= 16


class PagedAttentionKernelError(RuntimeError):
    """The Triton paged-attention kernel cannot run these inputs here."""


# --------------------------------------------------------------------------- shared launch code


def split_count(
    programs: int, max_context: int, min_split_keys: int, max_splits: int, device: torch.device
) -> int:
    """The KV splits of a split-KV attention launch whose grid has `programs` programs a
    split, from shapes only (never tensor values, so the choice is the same at capture and
    replay); 1 means one pass. Splitting pays when the programs would leave SMs idle: then up
    to two programs an SM, a split taking at least `min_split_keys` of the `max_context` keys
    the block table holds, at most `max_splits` splits. Paged attention's policy and MLA's."""
    sms = sm_count(device)
    if programs >= sms:
        return 1
    splits = min(
        triton.cdiv(2 * sms, programs), triton.cdiv(max_context, min_split_keys), max_splits
    )
    return max(splits, 1)


def check_device(
    x: Tensor, interpreted: bool, error: type[Exception], kernel: str, hint: str = ""
) -> None:
    """Raise `error` where a Triton attention kernel cannot compute on x's device: CPU tensors
    need the interpreter (`interpreted`: the kernel was defined under it), which computes
    bfloat16 wrongly. `hint` ends the first message (what to do instead)."""
    if x.device.type != "cpu":
        return
    if not interpreted:
        raise error(
            f"the Triton {kernel} kernel runs on CPU tensors only under the interpreter: "
            f"set TRITON_INTERPRET=1 before triton is first imported{hint}"
        )
    if x.dtype == torch.bfloat16:
        raise error(
            "the Triton interpreter computes bfloat16 wrongly; use float32 or float16 on CPU"
        )


def device_context(x: Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: make it x's for the launch (nothing on CPU)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def dot_precision(x: Tensor) -> str:
    """tl.dot's input precision for inputs like x: float32 inputs keep full precision on GPU
    (tf32 would lose ~3 digits); bf16/fp16 take the tensor-core path, where the flag has no
    effect; the interpreter computes in float32 ("ieee")."""
    return "ieee" if x.dtype == torch.float32 or x.device.type == "cpu" else "tf32"


def split_workspace(
    num_tokens: int, num_heads: int, num_splits: int, width: int, out: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The float32 partials a split launch writes (each split's max, sum and unnormalised
    accumulator): [T, H, S], [T, H, S] and [T, H, S, width] on out's device. A one-pass launch
    (num_splits 1) never touches them: `out` stands for all three."""
    if num_splits == 1:
        return out, out, out
    m_ws = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=out.device)
    acc_ws = torch.empty(
        (num_tokens, num_heads, num_splits, width), dtype=torch.float32, device=out.device
    )
    return m_ws, torch.empty_like(m_ws), acc_ws


# --------------------------------------------------------------------------- paged attention


def choose_num_splits(
    kernel_config: KernelConfig,
    num_tokens: int,
    num_kv_heads: int,
    max_context: int,
    device: torch.device,
) -> int:
    """How many KV splits to use, from shapes only (never tensor values, so the choice is the
    same at capture and replay). 1 means the single-pass kernel. `split_count` over the
    T * Hkv programs, with the launch's decode tier's MIN_SPLIT_KEYS and the config's
    max_splits; max_context is the block table's capacity, an upper bound on any sequence's
    length: at most the tier's UNSPLIT_KEYS, one split. The kernel gives a short sequence in
    a wide table fewer splits (one below 2 x MIN_SPLIT_KEYS keys), but the rest still launch
    (`unsplit_context`)."""
    attention = kernel_config.attention
    config = attention.decode(num_tokens, device.type)
    if max_context <= config.unsplit_keys:
        return 1
    # The first tier's launches take the one-token count: the same splits at 1 and at 2-16
    # tokens, so that a verification step's rows attend as one-token decodes do (tuning.py).
    tokens = 1 if config.least == 1 and device.type == "cuda" else num_tokens
    return split_count(
        tokens * num_kv_heads, max_context, config.min_split_keys, attention.max_splits, device
    )


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


def tiled_num_splits(
    kernel_config: KernelConfig,
    num_tokens: int,
    block_m: int,
    num_kv_heads: int,
    max_context: int,
    device: torch.device,
) -> int:
    """The tiled kernel's KV splits, from shapes only: `split_count` over the programs its
    tokens fill (ceil(T / BLOCK_M) tiles x Hkv; the grid's spare programs do nothing), each
    split at least `attention.tiled_min_split_keys` cached keys. A chunk of a few hundred
    tokens after a long cached prefix had a few dozen programs for the 132 SMs, each reading
    the whole prefix (176 tokens after 16,208 cached: 88 programs; H200, de44bba)."""
    attention = kernel_config.attention
    programs = triton.cdiv(num_tokens, block_m) * num_kv_heads
    return split_count(
        programs, max_context, attention.tiled_min_split_keys, attention.max_splits, device
    )


def _tiled_counters(device: torch.device, size: int) -> Tensor:
    """The tiled kernel's split arrival counters, one per (tile, KV head)."""
    return arrival_counters("paged_attention_tiled", device, size, PagedAttentionKernelError)


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
    if head_dim < MIN_DOT or head_dim & (head_dim - 1):
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
    if kv_cache.element_size() == 1 and kv_cache.dtype != KV_FP8_DTYPE:
        raise PagedAttentionKernelError(
            f"a {kv_cache.dtype} KV cache is not supported; FP8 caches are float8_e4m3fn "
            "(kv_cache_dtype 'fp8' / 'fp8_e4m3')"
        )
    if block_tables.stride(-1) != 1:
        raise PagedAttentionKernelError("block_tables must be contiguous in its last dimension")
    check_device(q, INTERPRETED, PagedAttentionKernelError, "paged-attention")


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
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    *,
    num_splits: int | None = None,
    tiled: bool | None = None,
    positions: Tensor | None = None,
    cos_sin_cache: Tensor | None = None,
    kernel_config: KernelConfig | None = None,
    write_first: bool | None = None,
) -> Tensor:
    """Same contract as `models.ops.paged_attention`: writes k/v into kv_cache through
    slot_mapping, returns attention output [T, Hq, D]. A float8_e4m3fn cache is written as
    k / k_scale, v / v_scale (float32 scalars on q's device; None: 1.0) and read times them.
    num_splits: None chooses from shapes
    (`choose_num_splits`, or `tiled_num_splits` for the tiled variant), 1 forces one pass,
    > 1 forces split-KV (the tiled variant splits its tiles' cached keys). tiled: True runs
    the query-tiled prefill variant, False the single-token kernel, None chooses
    (`choose_tiled`, only when num_splits is None). With positions [T] and
    cos_sin_cache [max_pos, rot_dim] q and k arrive unrotated and the kernel applies
    `models.ops.rotary` to them as it loads them (`paged_attention_rotary_ref`): the rotated
    keys are what it writes to the cache. kernel_config: launch configs, split policy and PDL
    (None: the defaults). write_first: the single-token kernel's launch is preceded by one
    that only writes the step's K/V into the cache, so that a token may read another token of
    the step from the cache (None: on CUDA for 2 to `attention.write_first_max_tokens` tokens;
    tuning.py). Without it a token reads them from k/v in a second key loop, whose tiles
    round differently from a decode's reading them from the cache."""
    kernel_config = kernel_config or tuning.default()
    rotary = _rotary_args(q, positions, cos_sin_cache)  # the call's own arguments first
    _validate(q, k, v, kv_cache, block_tables)
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape

    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    # The kernel writes k/v into the cache itself (one launch, no index_copy kernels).
    scales = _fp8_scales(kv_cache, q, k_scale, v_scale)
    if scales is None:
        k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)  # what the cache holds is what is read
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if slot_mapping.dtype != torch.int64:
        slot_mapping = slot_mapping.long()
    if tiled is None:
        tiled = num_splits is None and choose_tiled(
            kernel_config, num_tokens, block_tables.shape[0]
        )
    if tiled:
        if num_splits is not None and num_splits < 1:
            raise PagedAttentionKernelError(f"num_splits must be >= 1, got {num_splits}")
        if rotary is not None:
            # Prefill-heavy batches rotate first (the rotary kernel, one launch for q and k):
            # the tiled kernel's [64, D] query tiles rotated in registers would spill.
            positions, cos_sin_cache = rotary
            q, k = rotary_triton(positions, q, k, cos_sin_cache, kernel_config=kernel_config)
            rotary = None
        args = (q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc)
        _launch_tiled(*args, scale, out, kernel_config, scales=scales, num_splits=num_splits)
        # The decode tokens of the batch, one program per sequence (the tiled kernel skips
        # one-token sequences: a lone token in a 32-token tile wastes the dot's rows; measured
        # on the H200, 540 us a layer for 1,811 prefill + 237 decode tokens, of which the
        # prefill alone took 77 us). The two launches touch disjoint tokens.
        _launch_single(*args, scale, out, kernel_config, num_splits=1, by_seq=True, rotary=rotary,
                       scales=scales)  # fmt: skip
        return out
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(
            kernel_config, num_tokens, num_kv_heads, max_context, q.device
        )
    if num_splits < 1:
        raise PagedAttentionKernelError(f"num_splits must be >= 1, got {num_splits}")
    args = (q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale)
    if write_first is None:
        limit = kernel_config.attention.write_first_max_tokens
        write_first = q.device.type == "cuda" and 1 < num_tokens <= limit
    if write_first:
        _launch_single(*args, out, kernel_config, num_splits=1, by_seq=False, rotary=rotary,
                       scales=scales, write_only=True)  # fmt: skip
    _launch_single(*args, out, kernel_config, num_splits=num_splits, by_seq=False,
                   rotary=rotary, scales=scales)  # fmt: skip
    return out


def _fp8_scales(
    kv_cache: Tensor, q: Tensor, k_scale: Tensor | None, v_scale: Tensor | None
) -> tuple[Tensor, Tensor] | None:
    """An FP8 cache's (k_scale, v_scale) as the kernels read them, float32 scalars on q's
    device (1.0 where None); None for a cache of the model dtype, which takes no scales."""
    if kv_cache.dtype != KV_FP8_DTYPE:
        return None
    out = []
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            scale = torch.ones((), dtype=torch.float32, device=q.device)
        if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != q.device:
            raise PagedAttentionKernelError(
                f"{name} must be one float32 value on {q.device}, got {scale.dtype} "
                f"{tuple(scale.shape)} on {scale.device}"
            )
        out.append(scale)
    return out[0], out[1]


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
    scales: tuple[Tensor, Tensor] | None = None,
    write_only: bool = False,
) -> None:
    """Launch `_paged_attention_kernel` (inputs already validated and converted): a program
    per token (by_seq False) or, beside the tiled kernel, per one-token sequence (by_seq);
    write_only: only the cache write (num_splits 1)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    on_cpu = q.device.type == "cpu"
    config = kernel_config.attention.decode(num_tokens, q.device.type)
    group = num_q_heads // num_kv_heads
    block_g = max(MIN_DOT, triton.next_power_of_2(group))
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (block_tables.shape[0] if by_seq else num_tokens, num_kv_heads, num_splits)

    m_ws, l_ws, acc_ws = split_workspace(num_tokens, num_q_heads, num_splits, head_dim, out)
    # The single-pass kernel never touches the counters.
    counters = _split_counters(q.device, grid[0] * grid[1]) if num_splits > 1 else out
    rotary_ptrs, rotary_consts = _rotary_launch_args(rotary, slot_mapping)
    pdl = pdl_on(kernel_config, q.device, num_tokens)

    with device_context(q):
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
            scale * LOG2E,
            *_strides(q, out, k, v, k_cache, block_tables),
            *rotary_ptrs,
            *(scales or (slot_mapping, slot_mapping)),  # never read without FP8_KV
            GROUP=group,
            BLOCK_G=block_g,
            HEAD_DIM=head_dim,
            KV_BLOCK_SIZE=block_size,
            BLOCK_N=config.block_n,
            NUM_SPLITS=num_splits,
            MIN_SPLIT_KEYS=config.min_split_keys,
            UNSPLIT_KEYS=config.unsplit_keys,
            COMBINE_G=triton.next_power_of_2(group),
            COMBINE_S=min(
                kernel_config.attention.combine_splits, triton.next_power_of_2(num_splits)
            ),
            COMPUTE_F32=on_cpu,
            DOT_PRECISION=dot_precision(q),
            BY_SEQ=by_seq,
            **rotary_consts,
            FP8_KV=scales is not None,
            # With FMA contraction the H200 skipped the rotation's rounding steps (51,248 of
            # 256 x 8 x 128 keys off by an ulp at batch 256); without it, bit-exact.
            enable_fp_fusion=rotary is None,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            # A register cap, where a config sets one: more programs resident an SM.
            **({"maxnreg": config.maxnreg} if config.maxnreg is not None else {}),
            PDL=pdl,
            WRITE_ONLY=write_only,
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
    *,
    scales: tuple[Tensor, Tensor] | None = None,
    num_splits: int | None = None,
) -> None:
    """Launch `_paged_attention_tiled_kernel` (inputs already validated and converted), its
    cached keys split num_splits ways (None: `tiled_num_splits`)."""
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
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    # An upper bound on the tiles from shapes only: sequence b's tiles start at
    # query_start_loc[b] // BLOCK_M + b, and the padding past query_start_loc[-1] is one more
    # "sequence". Programs past the last tile find no rows and store nothing.
    tiles = num_tokens // block_m + num_seqs + 1
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        num_splits = tiled_num_splits(
            kernel_config, num_tokens, block_m, num_kv_heads, max_context, q.device
        )
    grid = (tiles, num_kv_heads) if num_splits == 1 else (tiles, num_kv_heads, num_splits)
    m_ws, l_ws, acc_ws = split_workspace(num_tokens, num_q_heads, num_splits, head_dim, out)
    counters = out if num_splits == 1 else _tiled_counters(q.device, tiles * num_kv_heads)
    with device_context(q):
        _paged_attention_tiled_kernel[grid](
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
            num_tokens,
            num_seqs,
            num_q_heads,
            scale * LOG2E,
            *_strides(q, out, k, v, k_cache, block_tables),
            *(scales or (slot_mapping, slot_mapping)),  # never read without FP8_KV
            GROUP=group,
            GROUP_P2=group_p2,
            BLOCK_M=block_m,
            HEAD_DIM=head_dim,
            KV_BLOCK_SIZE=block_size,
            BLOCK_N=config.block_n,
            COMPUTE_F32=on_cpu,
            DOT_PRECISION=dot_precision(q),
            FP8_KV=scales is not None,
            NUM_SPLITS=num_splits,
            MIN_SPLIT_KEYS=kernel_config.attention.tiled_min_split_keys,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
