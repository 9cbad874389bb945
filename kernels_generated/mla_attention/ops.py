"""The custom op the mla_absorb pass emits on h100 and its fake: `ce::mla_latent_attention`'s
schema and the kernel config's key last (kernels_generated/tuning.py), opaque to Dynamo and
Inductor (torch.library.triton_op fails under torch.compile on CPU)."""

from __future__ import annotations

import torch
from torch import Tensor

from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.mla_attention.launch import mla_latent_attention_triton
from compile_engine.models.mla import mla_latent_attention_fake


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
    tuning_key: str,
) -> Tensor:
    """`ce::mla_latent_attention` computed by the Triton kernel (split-KV chosen from shapes)."""
    return mla_latent_attention_triton(
        q_latent, kv_latent, latent_cache, slot_mapping, block_tables, seq_lens,
        query_start_loc, kv_lora_rank, scale, kernel_config=tuning.resolve(tuning_key),
    )  # fmt: skip


@mla_latent_attention.register_fake
def _mla_latent_attention_kernel_fake(
    q_latent: Tensor,
    kv_latent: Tensor,
    latent_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    kv_lora_rank: int,
    scale: float,
    tuning_key: str,
) -> Tensor:
    return mla_latent_attention_fake(
        q_latent, kv_latent, latent_cache, slot_mapping, block_tables, seq_lens,
        query_start_loc, kv_lora_rank, scale,
    )  # fmt: skip
