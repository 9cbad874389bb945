"""MLA latent attention's launch: input checks, the split count and the kernel calls.

The launch code is paged attention's (kernels_generated/paged_attention/launch.py): the same
split policy with MLA's numbers (`split_count`; min_split_keys and max_splits are the kernel
config's `MlaTuning`), the same device checks, launch device, dot precision and partials'
workspace. What stays MLA's own: the shape checks, the latent write (`index_copy_` before the
launch) and the reduce kernel that combines the splits (paged attention's last split combines
them in the kernel itself; MLA's combine is a second launch).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.mla_attention.kernels import (
    INTERPRETED,
    _mla_latent_kernel,
    _reduce_splits_kernel,
)
from compile_engine.kernels_generated.paged_attention.launch import (
    LOG2E,
    MIN_DOT,
    check_device,
    device_context,
    dot_precision,
    split_count,
    split_workspace,
)
from compile_engine.kernels_generated.tuning import KernelConfig


class MLAKernelError(RuntimeError):
    """The Triton MLA kernel cannot run these inputs here."""


def choose_num_splits(
    kernel_config: KernelConfig,
    num_tokens: int,
    num_head_blocks: int,
    max_context: int,
    device: torch.device,
) -> int:
    """How many KV splits, from shapes only (the same at capture and replay); 1 = single
    pass. `split_count` over the T * head-block programs with the config's MLA numbers;
    max_context is the block table's capacity, an upper bound on any sequence's length."""
    mla = kernel_config.mla
    return split_count(
        num_tokens * num_head_blocks, max_context, mla.min_split_keys, mla.max_splits, device
    )


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
    check_device(
        q_latent, INTERPRETED, MLAKernelError, "MLA",
        hint=" (or leave the mla_absorb pass on the cpu target, which uses the reference)",
    )  # fmt: skip


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
    kernel_config: KernelConfig | None = None,
) -> Tensor:
    """Same contract as `models.mla.mla_latent_attention`: writes kv_latent into the cache
    through slot_mapping, returns [T, H, R]. num_splits: None chooses from shapes, 1 forces
    the single pass. kernel_config: the tiles and the split policy (None: the defaults; a
    tile sweep passes configs whose `MlaTuning` differs)."""
    kernel_config = kernel_config or tuning.default()
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
    config = kernel_config.mla.latent(q_latent.device.type)
    block_h = max(MIN_DOT, min(config.block_h, triton.next_power_of_2(num_heads)))
    head_blocks = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(
            kernel_config, num_tokens, head_blocks, max_context, q_latent.device
        )
    if num_splits < 1:
        raise MLAKernelError(f"num_splits must be >= 1, got {num_splits}")
    m_ws, l_ws, acc_ws = split_workspace(num_tokens, num_heads, num_splits, rank, out)

    grid = (num_tokens, head_blocks, num_splits)
    with device_context(q_latent):
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
            scale * LOG2E,
            q_latent.stride(0),
            q_latent.stride(1),
            out.stride(0),
            out.stride(1),
            latent_cache.stride(0),
            latent_cache.stride(1),
            block_tables.stride(0),
            RANK=rank,
            ROPE=rope,
            BLOCK_R=max(MIN_DOT, triton.next_power_of_2(rank)),
            BLOCK_P=max(MIN_DOT, triton.next_power_of_2(rope)),
            BLOCK_H=block_h,
            KV_BLOCK_SIZE=block_size,
            BLOCK_N=config.block_n,
            NUM_SPLITS=num_splits,
            COMPUTE_F32=on_cpu,
            DOT_PRECISION=dot_precision(q_latent),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        if num_splits > 1:
            block_rr = min(kernel_config.mla.reduce_block_r, triton.next_power_of_2(rank))
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
                num_warps=config.reduce_warps,
            )
    return out
