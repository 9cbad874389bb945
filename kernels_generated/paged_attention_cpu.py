"""Paged attention on the CPU for decode steps: the reference's arithmetic in few ATen calls.

`ce.paged_attention`'s reference (models/ops.py) is written to be read: per step it walks the
batch in Python, builds index tensors from lists and treats decode and prefill rows apart.
On the 2-core CPU that is ~490 us a layer for one decode token over a 40-token context (issue
29's profile of SmolLM2: 14.7 ms of a 47 ms step), nearly all of it dispatch and Python. A
step in which every sequence has exactly one new token (decode, the step the latency target
times) needs none of that: the K/V write is one indexed store, the context one gather of the
block table's first blocks, the mask one compare, then the same SDPA call. Other steps
(prefill, mixed) run the reference. The output equals the reference's: same gather, same
mask, same SDPA (tests/kernels/test_paged_attention_cpu.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from compile_engine.models.ops import (
    KV_FP8_DTYPE,
    dequantize_kv,
    paged_attention_fake,
    paged_attention_ref,
    quantize_kv,
)


def paged_attention_cpu_impl(
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
) -> Tensor:
    tokens, batch = q.shape[0], seq_lens.shape[0]
    # Not one new token a sequence, or an FP8 cache (the reference quantizes and dequantizes).
    if tokens != batch or int(query_start_loc[-1]) != tokens or kv_cache.dtype == KV_FP8_DTYPE:
        return paged_attention_ref(
            q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
            k_scale, v_scale,
        )  # fmt: skip
    _, num_blocks, block_size, heads_kv, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, heads_kv, head_dim)
    flat[:, slot_mapping] = torch.stack([k, v]).to(kv_cache.dtype)  # [2, T, Hkv, D]
    max_len = int(seq_lens.max())
    blocks = -(-max_len // block_size)
    context = kv_cache[:, block_tables[:, :blocks]]  # [2, B, nb, bs, Hkv, D]
    context = context.flatten(2, 3)[:, :, :max_len].transpose(2, 3).to(q.dtype)  # [2,B,Hkv,L,D]
    mask = None
    if batch > 1:  # one sequence attends to all max_len keys: no mask (SDPA's fast path)
        mask = torch.arange(max_len)[None, :] < seq_lens[:, None]  # [B, L]
        mask = mask[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, Hq, 1, D]
        context[0],
        context[1],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)  # [T, Hq, D]


def paged_attention_decode_cpu(
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
    config_key: str,
) -> Tensor:
    """The decode step's attention with no host read, traceable into the graph: the CPU's
    decode graph (compiler/compiled_model.py) inlines it, so a decode step is one compiled
    graph, not 31 pieces with 30 eager attention calls between them. Valid only when every
    sequence has exactly one new token (T == B); the context is the block table's whole width
    (the widest sequence's blocks, as the runner sizes it), masked by seq_lens, so the numbers
    are `paged_attention_cpu_impl`'s: the same keys reach softmax, the rest weigh zero."""
    _, num_blocks, block_size, heads_kv, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, heads_kv, head_dim)
    new = torch.stack(
        [quantize_kv(k, k_scale, kv_cache.dtype), quantize_kv(v, v_scale, kv_cache.dtype)]
    )  # [2, T, Hkv, D]
    if kv_cache.dtype == KV_FP8_DTYPE:  # no float8 index_put on the CPU: write the bytes
        flat.view(torch.uint8)[:, slot_mapping] = new.view(torch.uint8)
    else:
        flat[:, slot_mapping] = new
    width = block_tables.shape[1] * block_size
    context = kv_cache[:, block_tables].flatten(2, 3).transpose(2, 3)  # [2, B, Hkv, L, D]
    keys = dequantize_kv(context[0], k_scale, q.dtype)
    values = dequantize_kv(context[1], v_scale, q.dtype)
    positions = torch.arange(width, device=q.device)
    mask = (positions[None, :] < seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, Hq, 1, D]
        keys,
        values,
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)  # [T, Hq, D]


# Registered through torch.library.Library with a CPU kernel, not `custom_op`: the latter's
# Python wrapper costs ~70 us a call here (a 50 us call became 120: 2 ms of a 30-layer step).
_LIB = torch.library.Library("ce_kernels", "FRAGMENT")
_LIB.define(
    "paged_attention_cpu(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping, "
    "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, Tensor? k_scale, "
    "Tensor? v_scale, str config_key)"
    " -> Tensor"
)


def _paged_attention_cpu(
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
    config_key: str,
) -> Tensor:
    """`ce.paged_attention`'s schema (plus the kernel config's key, unused here)."""
    return paged_attention_cpu_impl(
        q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
        k_scale, v_scale,
    )  # fmt: skip


_LIB.impl("paged_attention_cpu", _paged_attention_cpu, "CPU")


@torch.library.register_fake("ce_kernels::paged_attention_cpu", lib=_LIB)
def paged_attention_cpu_fake(
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
    config_key: str,
) -> Tensor:
    return paged_attention_fake(
        q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale
    )
