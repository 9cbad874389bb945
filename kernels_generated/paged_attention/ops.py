"""The custom ops the passes emit for paged attention, opaque to Dynamo and Inductor (a
torch.library.triton_op fails under torch.compile on CPU), and their fakes. Each takes the
kernel config's key as its last argument (kernels_generated/tuning.py) and resolves it for the
launch (launch.py)."""

from __future__ import annotations

import torch
from torch import Tensor

from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.paged_attention.launch import paged_attention_triton
from compile_engine.models.ops import paged_attention_fake, paged_attention_ref, rotary_ref


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
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    tuning_key: str,
) -> Tensor:
    """`ce::paged_attention` computed by the Triton kernel (split-KV chosen from shapes)."""
    return paged_attention_triton(
        q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
        kernel_config=tuning.resolve(tuning_key), k_scale=k_scale, v_scale=v_scale,
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
    k_scale: Tensor | None,
    v_scale: Tensor | None,
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
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    positions: Tensor,
    cos_sin_cache: Tensor,
) -> Tensor:
    """What `ce_kernels::paged_attention_rotary` computes: `ce::rotary`, then attention."""
    q, k = rotary_ref(positions, q, k, cos_sin_cache)
    return paged_attention_ref(
        q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
        k_scale, v_scale,
    )  # fmt: skip


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
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    positions: Tensor,
    cos_sin_cache: Tensor,
    tuning_key: str,
) -> Tensor:
    """`ce::paged_attention` of the rotated q and k (`ce::rotary`), the rotation done by the
    Triton kernel as it loads them: no rotary kernel, no rotated copies of q and k."""
    return paged_attention_triton(
        q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
        positions=positions, cos_sin_cache=cos_sin_cache,
        kernel_config=tuning.resolve(tuning_key), k_scale=k_scale, v_scale=v_scale,
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
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    positions: Tensor,
    cos_sin_cache: Tensor,
    tuning_key: str,
) -> Tensor:
    return torch.empty_like(q)
