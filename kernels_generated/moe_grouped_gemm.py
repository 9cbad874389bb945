"""The routed experts of a sparse MoE layer in Triton: align, two grouped GEMMs, combine.

Lowers the chain `moe_align -> moe_grouped_gemm(w13) -> silu_and_mul -> moe_grouped_gemm(w2)
-> moe_combine` of models/moe.py (its references are the oracle) to one op,
`ce_kernels::moe_fused_experts(x, w13, w2, topk_weights, topk_ids) -> [T, H]`:

1. **Align** (`_moe_align_kernel`, one program): count the slots (token, choice) per expert,
   pad each expert's run to BLOCK_M rows, write `sorted_ids` (slots expert by expert, the
   sentinel T*K in padding) and `block_expert` (the expert of each BLOCK_M rows, -1 past the
   last). Sizes come from T alone (`models.moe.align_capacity`): no host synchronisation, so
   the launch can be captured in a CUDA graph. Above `_ALIGN_ONE_PROGRAM_SLOTS` slots one
   program would serialise too much; there the sync-free torch reference runs instead.
2. **GEMM 1 with silu_and_mul in its epilogue**: a program owns BLOCK_M rows of one expert and
   BLOCK_N of the I output columns; it multiplies the gathered token rows by the expert's gate
   rows *and* up rows (two tl.dot accumulators) and stores silu(gate) * up: the [T*K, 2I]
   intermediate never exists.
3. **GEMM 2 with the routing weight in its epilogue**: rows scaled by their slot's weight.
4. **Combine**: [T, K, H] summed over K (one reduction; deterministic, unlike atomics).

Programs whose block is past the last (-1) exit at once: the grid is sized from the capacity
bound, the work from the routing. Within the grid, GROUP_M row blocks share each weight column
tile before moving on, so consecutive programs of one expert find its weights in L2.

Tiles (BLOCK_M shared by both GEMMs, since it fixes the alignment; BLOCK_N, BLOCK_K, GROUP_M,
warps, stages per GEMM) live in configs/moe_grouped_gemm.json keyed by experts E, hidden H,
expert width I and slots M = T*K (nearest key, log2 distance); `compile-engine bench kernel
moe_grouped_gemm [--tune]` checks, times and tunes them (benchmarks/kernel_harness.py). On CPU
the kernels run only under the Triton interpreter (TRITON_INTERPRET=1 before triton is
imported), which computes bf16 wrongly: there tiles are cast to float32 after loading, and CPU
callers use fp32/fp16.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.configs import TARGET_OF_DEVICE
from compile_engine.kernels_generated.tuning import KernelConfig
from compile_engine.models.moe import (
    align_capacity,
    moe_align_ref,
    moe_combine_ref,
    moe_grouped_gemm_ref,
)
from compile_engine.models.ops import silu_and_mul_ref

_ALIGN_CHUNK = 64
# One align program walks the slots in chunks of 64 with a [64, E] comparison each: at a few
# microseconds per chunk it stays below the GEMMs' time up to here; beyond, the torch reference
# (sort + scatter, many programs) is faster.
_ALIGN_ONE_PROGRAM_SLOTS = 4096
# Hopper's shared memory a program (227 KiB opt-in on H100 / H200).
SHARED_MEMORY_BYTES = 232448


class MoEKernelError(RuntimeError):
    """The Triton MoE kernels cannot run these inputs here; the message says why."""


# --------------------------------------------------------------------------- kernels


@triton.jit
def _moe_align_kernel(
    ids_ptr,  # [S] int32, the expert of each slot
    sorted_ptr,  # [P] int32 out
    block_expert_ptr,  # [P / BLOCK_M] int32 out
    cursor_ptr,  # [E_PAD] int32 scratch: next free row of each expert
    num_slots,
    capacity,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
):
    experts = tl.arange(0, E_PAD)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_slots, CHUNK):
        offs = start + lanes
        ids = tl.load(ids_ptr + offs, mask=offs < num_slots, other=E_PAD)  # E_PAD: no expert
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # [E_PAD] end row of each expert's run
    total = tl.sum(padded, axis=0)
    cursor = ends - padded
    tl.store(cursor_ptr + experts, cursor)

    # The expert of a block is the number of runs that end at or before its first row.
    num_blocks = capacity // BLOCK_M
    for first in range(0, num_blocks, CHUNK):
        blocks = first + lanes
        row = blocks * BLOCK_M
        expert = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), axis=1)
        expert = tl.where(row < total, expert, -1)
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < num_blocks)
    for first in range(0, capacity, CHUNK):
        rows = first + lanes
        tl.store(sorted_ptr + rows, tl.zeros([CHUNK], dtype=tl.int32) + num_slots,
                 mask=rows < capacity)  # fmt: skip
    tl.debug_barrier()

    # Place each slot: its expert's cursor plus its rank among same-expert slots of the chunk.
    earlier = lanes[None, :] < lanes[:, None]
    for start in range(0, num_slots, CHUNK):
        offs = start + lanes
        valid = offs < num_slots
        ids = tl.load(ids_ptr + offs, mask=valid, other=E_PAD)
        rank = tl.sum(((ids[:, None] == ids[None, :]) & earlier).to(tl.int32), axis=1)
        base = tl.load(cursor_ptr + ids, mask=valid, other=0)
        tl.store(sorted_ptr + base + rank, offs, mask=valid)
        cursor += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
        tl.debug_barrier()
        tl.store(cursor_ptr + experts, cursor)
        tl.debug_barrier()


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # [M, K] rows read through the slots
    w_ptr,  # [E, N or 2N, K]
    out_ptr,  # [S, N]
    weights_ptr,  # [S] float32 routing weights (MUL_WEIGHTS)
    sorted_ptr,  # [P] int32
    block_expert_ptr,  # [P / BLOCK_M] int32
    num_slots,
    N,
    K,
    num_blocks_m,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    ROWS_PER_TOKEN: tl.constexpr,
    SILU: tl.constexpr,
    MUL_WEIGHTS: tl.constexpr,
    COMPUTE_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row blocks (usually one expert's) walk the N tiles together.
    in_group = GROUP_M * num_pid_n
    group = pid // in_group
    first_m = group * GROUP_M
    group_size = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size

    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= 0:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slots = tl.load(sorted_ptr + offs_m)
        valid = slots < num_slots
        rows = (slots // ROWS_PER_TOKEN).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
        w_ptrs = (
            w_ptr
            + expert.to(tl.int64) * stride_we
            + offs_n[None, :].to(tl.int64) * stride_wn
            + offs_k[:, None]
        )  # [BLOCK_K, BLOCK_N]: the expert's rows, transposed by indexing
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_mask = offs_k < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if COMPUTE_F32:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
            if SILU:  # the up rows sit N rows below the gate rows
                u = tl.load(w_ptrs + N * stride_wn, mask=k_mask[:, None] & n_mask[None, :],
                            other=0.0)  # fmt: skip
                if COMPUTE_F32:
                    u = u.to(tl.float32)
                acc_up = tl.dot(a, u, acc_up, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        if MUL_WEIGHTS:
            acc = acc * tl.load(weights_ptr + slots, mask=valid, other=0.0)[:, None]
        out_ptrs = out_ptr + slots[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


INTERPRETED = not isinstance(_moe_gemm_kernel, JITFunction)
"""True when triton was imported with TRITON_INTERPRET=1: kernels then run on CPU tensors."""


# --------------------------------------------------------------------------- launchers


def shape_key(num_experts: int, hidden: int, inter: int, num_slots: int) -> dict[str, int]:
    return {"E": num_experts, "H": hidden, "I": inter, "M": max(num_slots, 1)}


def pick_config(
    kernel_config: KernelConfig,
    num_experts: int,
    hidden: int,
    inter: int,
    num_slots: int,
    device: torch.device,
) -> dict:
    """The tiles of the kernel config's table nearest this shape."""
    target = TARGET_OF_DEVICE.get(device.type, device.type)
    table = kernel_config.table("moe_grouped_gemm")
    return table.lookup(target, shape_key(num_experts, hidden, inter, num_slots))


def _device_guard(t: Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _check_device(t: Tensor) -> None:
    if t.device.type == "cpu" and not INTERPRETED:
        raise MoEKernelError(
            "the Triton MoE kernels run on CPU tensors only under the interpreter: set "
            "TRITON_INTERPRET=1 before triton is first imported"
        )
    if t.device.type == "cpu" and t.dtype == torch.bfloat16:
        raise MoEKernelError(
            "the Triton interpreter computes bfloat16 wrongly; use float32 or float16 on CPU"
        )


def moe_align_triton(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """Same contract as models.moe.moe_align (the placement within an expert's run may differ
    from the reference's stable order; every consumer is indifferent to it)."""
    num_slots = topk_ids.numel()
    if num_slots > _ALIGN_ONE_PROGRAM_SLOTS:
        return moe_align_ref(topk_ids, num_experts, block_m)
    capacity = align_capacity(num_slots, num_experts, block_m)
    device = topk_ids.device
    sorted_ids = torch.empty(capacity, dtype=torch.int32, device=device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    if capacity == 0:
        return sorted_ids, block_expert
    e_pad = triton.next_power_of_2(num_experts)
    cursor = torch.empty(e_pad, dtype=torch.int32, device=device)
    ids = topk_ids.reshape(-1).to(torch.int32)
    with _device_guard(ids):
        _moe_align_kernel[(1,)](
            ids,
            sorted_ids,
            block_expert,
            cursor,
            num_slots,
            capacity,
            E_PAD=e_pad,
            BLOCK_M=block_m,
            CHUNK=_ALIGN_CHUNK,
            num_warps=4 if e_pad <= 128 else 8,
        )
    return sorted_ids, block_expert


def moe_gemm_triton(
    a: Tensor,
    w: Tensor,
    sorted_ids: Tensor,
    block_expert: Tensor,
    rows_per_token: int,
    tiles: dict,
    *,
    silu: bool = False,
    topk_weights: Tensor | None = None,
) -> Tensor:
    """out[s] = a[s // rows_per_token] @ w[expert(s)]^T for every slot s, [M * r, N]; with
    silu, w holds [gate | up] rows ([E, 2N, K]) and out = silu(a @ gate^T) * (a @ up^T); with
    topk_weights [T, K], each row is scaled by its slot's weight."""
    _check_device(a)
    num_slots = a.shape[0] * rows_per_token
    n_out = w.shape[1] // 2 if silu else w.shape[1]
    k_in = w.shape[2]
    if a.shape[1] != k_in:
        raise MoEKernelError(f"a {tuple(a.shape)} and w {tuple(w.shape)} disagree on K")
    out = torch.empty(num_slots, n_out, dtype=a.dtype, device=a.device)
    num_blocks_m = block_expert.numel()
    if num_slots == 0 or num_blocks_m == 0:
        return out
    block_m = sorted_ids.numel() // num_blocks_m
    a = a if a.stride(-1) == 1 else a.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    on_cpu = a.device.type == "cpu"
    weights = topk_weights.reshape(-1) if topk_weights is not None else out
    grid = (num_blocks_m * triton.cdiv(n_out, tiles["BLOCK_N"]),)
    with _device_guard(a):
        _moe_gemm_kernel[grid](
            a,
            w,
            out,
            weights,
            sorted_ids,
            block_expert,
            num_slots,
            n_out,
            k_in,
            num_blocks_m,
            a.stride(0),
            w.stride(0),
            w.stride(1),
            out.stride(0),
            ROWS_PER_TOKEN=rows_per_token,
            SILU=silu,
            MUL_WEIGHTS=topk_weights is not None,
            COMPUTE_F32=on_cpu,
            # float32 keeps full precision (tf32 would lose ~3 digits); bf16/fp16 ignore it.
            DOT_PRECISION="ieee" if a.dtype == torch.float32 or on_cpu else "tf32",
            BLOCK_M=block_m,
            BLOCK_N=tiles["BLOCK_N"],
            BLOCK_K=tiles["BLOCK_K"],
            GROUP_M=tiles.get("GROUP_M", 8),
            num_warps=tiles.get("num_warps", 4),
            num_stages=fit_stages(tiles, block_m, a.element_size(), silu),
        )
    return out


def fit_stages(tiles: dict, block_m: int, element_size: int, silu: bool) -> int:
    """The tiles' pipeline depth cut to what fits in a program's shared memory. The table is
    tuned in bf16; a float32 model's tiles take twice the bytes (128 x 128 gate and up tiles
    at 3 stages asked for 272 KiB on the H200). Triton keeps stages - 1 tiles of A and of each
    weight in flight: that is what must fit."""
    per_stage = (block_m + (2 if silu else 1) * tiles["BLOCK_N"]) * tiles["BLOCK_K"] * element_size
    stages = tiles.get("num_stages", 2)
    while stages > 1 and (stages - 1) * per_stage > SHARED_MEMORY_BYTES:
        stages -= 1
    return stages


def fused_experts(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    config: dict | None = None,
    kernel_config: KernelConfig | None = None,
) -> Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, K], topk_ids [T, K] ->
    sum_k topk_weights[t, k] * expert_k(x[t]), [T, H]. config: tiles as in the config file
    (default: the entry of kernel_config's table nearest this shape and device)."""
    _check_device(x)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    if config is None:
        config = pick_config(
            kernel_config or tuning.default(), num_experts, hidden, two_inter // 2,
            num_tokens * top_k, x.device,
        )  # fmt: skip
    sorted_ids, block_expert = moe_align_triton(topk_ids, num_experts, config["BLOCK_M"])
    act = moe_gemm_triton(x, w13, sorted_ids, block_expert, top_k, config["gemm1"], silu=True)
    y = moe_gemm_triton(
        act, w2, sorted_ids, block_expert, 1, config["gemm2"], topk_weights=topk_weights
    )  # [T*K, H], already weighted
    return y.view(num_tokens, top_k, hidden).sum(dim=1)


def fused_experts_ref(
    x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor
) -> Tensor:
    """The chain the pass replaces, from the models/moe.py references."""
    top_k = topk_ids.shape[1]
    sorted_ids, block_expert = moe_align_ref(topk_ids, w13.shape[0], 16)
    h = moe_grouped_gemm_ref(x, w13, sorted_ids, block_expert, top_k)
    y = moe_grouped_gemm_ref(silu_and_mul_ref(h), w2, sorted_ids, block_expert, 1)
    return moe_combine_ref(y, topk_weights)


# The op the MoE pass swaps in for the chain: opaque to Dynamo and Inductor (a triton_op
# fails under torch.compile on CPU, where the interpreter would run on fake tensors).
@torch.library.custom_op("ce_kernels::moe_fused_experts", mutates_args=())
def moe_fused_experts(
    x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, tuning_key: str
) -> Tensor:
    """Routed experts of one MoE layer: align + grouped GEMMs (silu fused) + combine, tiles
    from the kernel config whose key the pass gave (tuning.py)."""
    kernel_config = tuning.resolve(tuning_key)
    return fused_experts(x, w13, w2, topk_weights, topk_ids, kernel_config=kernel_config)


@moe_fused_experts.register_fake
def _(
    x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, tuning_key: str
) -> Tensor:
    return x.new_empty((topk_ids.shape[0], w2.shape[1]))
