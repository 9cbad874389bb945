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

The decode graph's form (`paged_attention_decode_cpu`) keeps the store; its read is C++
(`decode_read_kernel`: float32 caches of the head sizes built), else reductions Inductor fuses
with the gather, traced to one subgraph that every layer calls (docs/compiler.md, section 2):
the same keys reach softmax, in another summation order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._higher_order_ops.invoke_subgraph import invoke_subgraph_infer

from compile_engine.models.ops import (
    KV_FP8_DTYPE,
    dequantize_kv,
    paged_attention_fake,
    paged_attention_ref,
    quantize_kv,
)
from compile_engine.models.quant import vnni_cpu_isas

DECODE_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"
# (head size, query heads a KV head) the C++ read is built for (its `task_for`); others, and
# caches not in float32, take the Inductor-fused read.
DECODE_SHAPES = {(64, 1), (64, 2), (64, 3), (64, 4), (128, 1), (128, 2), (128, 4)}


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
    (the widest sequence's blocks, as the runner sizes it), masked by seq_lens: the same keys
    reach softmax as in `paged_attention_cpu_impl`, the rest weigh zero (float32 rounding of
    another summation order apart)."""
    _, num_blocks, block_size, heads_kv, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, heads_kv, head_dim)
    new = torch.stack(
        [quantize_kv(k, k_scale, kv_cache.dtype), quantize_kv(v, v_scale, kv_cache.dtype)]
    )  # [2, T, Hkv, D]
    if kv_cache.dtype == KV_FP8_DTYPE:  # no float8 index_put on the CPU: write the bytes
        flat.view(torch.uint8)[:, slot_mapping] = new.view(torch.uint8)
    else:
        flat[:, slot_mapping] = new
    group = q.shape[1] // heads_kv
    if kv_cache.dtype == q.dtype == torch.float32 and (head_dim, group) in DECODE_SHAPES:
        kernel = decode_read_kernel()
        if kernel is not None:  # the C++ read: each sequence's own keys, no masked ones
            tables, lens = block_tables.to(torch.int32), seq_lens.to(torch.int32)
            return kernel(q.contiguous(), kv_cache, tables, lens, scale)
    if torch.compiler.is_dynamo_compiling():  # Dynamo traces this (tests): inline the read
        return _decode_read(q, kv_cache, block_tables, seq_lens, k_scale, v_scale, scale)
    # AOTAutograd traces it (the decode graph's lowering, passes/paged_attention_cpu.py): the
    # read becomes one subgraph shared by the layers; in eager, a plain call.
    scales = tuple(s for s in (k_scale, v_scale) if s is not None)
    read = _decode_read_region(scale, k_scale is not None, v_scale is not None)
    return invoke_subgraph_infer(read, q, kv_cache, block_tables, seq_lens, *scales)[0]


@functools.cache
def decode_read_kernel() -> Callable[..., Tensor] | None:
    """`ce_cpu::paged_decode_read` (csrc/paged_decode_cpu.cpp: a task per sequence and KV head
    walks that sequence's keys only, each key loaded once for its query heads), built once per
    source, torch and flags for the machine's vector ISA as the vnni_cpu kernel is; None where
    that kernel cannot build (no g++, not x86 Linux): the Inductor-fused `_decode_read` then
    reads, over the block table's whole width. SmolLM2 Q4_1 on the 2-core Xeon, `bench
    latency` (A/B, same hour): batch 1 159.1 -> 166.9 tok/s, batch 16 663.5 -> 685.1; alone,
    16 rows over 96 / 600 keys 169 / 847 us (Inductor, static shapes) against 75 / 682, where
    600 keys of float32 K and V (14.7 MB) are a read of memory either way."""
    isas = vnni_cpu_isas()
    if not isas:
        return None
    from compile_engine.kernels_generated.vnni_linear_cpu import (
        CXX_FLAGS,
        ISA_FLAGS,
        build_library,
    )

    flags = (*CXX_FLAGS, *ISA_FLAGS[isas[0]])
    torch.ops.load_library(str(build_library(DECODE_SOURCE, "paged_decode_read", flags)))

    @torch.library.register_fake("ce_cpu::paged_decode_read")
    def _fake(q, kv_cache, block_tables, seq_lens, scale):
        return torch.empty_like(q)

    return torch.ops.ce_cpu.paged_decode_read


def _decode_read(
    q: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    scale: float,
) -> Tensor:
    """The decode step's attention read: softmax over the block table's keys written out in
    reductions, which Inductor fuses with the gather, so that each key is read from the cache
    where it lies and never copied into a [B, Hkv, L, D] context for SDPA. SmolLM2's heads
    over 600 keys on the 2-core Xeon: 84 / 194 us a layer at 1 / 4 rows against SDPA on the
    gathered context's 168 / 374 (f257d1c)."""
    _, num_blocks, block_size, heads_kv, head_dim = kv_cache.shape
    rows, width = q.shape[0], block_tables.shape[1] * block_size
    group = q.shape[1] // heads_kv
    keys = dequantize_kv(kv_cache[0][block_tables], k_scale, q.dtype)  # [B, nb, bs, Hkv, D]
    values = dequantize_kv(kv_cache[1][block_tables], v_scale, q.dtype)
    keys = keys.view(rows, width, heads_kv, 1, head_dim)
    values = values.view(rows, width, heads_kv, 1, head_dim)
    grouped = q.view(rows, 1, heads_kv, group, head_dim)  # query head h reads KV head h // G
    scores = (grouped * keys).sum(-1) * scale  # [B, L, Hkv, G]
    positions = torch.arange(width, device=q.device)
    mask = (positions[None, :] < seq_lens[:, None])[:, :, None, None]  # [B, L, 1, 1]
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=1)
    out = (weights[..., None] * values).sum(1)  # [B, Hkv, G, D]
    return out.view(rows, heads_kv * group, head_dim)  # [T, Hq, D]


@functools.cache
def _decode_read_region(scale: float, has_k_scale: bool, has_v_scale: bool):
    """`_decode_read` as one subgraph object per (scale, which FP8 scales): every layer's
    call traces to the same `invoke_subgraph`, which Inductor compiles once and calls from
    each layer (the layers' attention inlined compiled 30 copies of the fused kernels: +25-31
    s on a cold SmolLM2 start)."""

    def read(q, kv_cache, block_tables, seq_lens, *scales):
        it = iter(scales)
        k_scale = next(it) if has_k_scale else None
        v_scale = next(it) if has_v_scale else None
        # A tuple, as a subgraph's outputs are (Inductor reads them as one).
        return (_decode_read(q, kv_cache, block_tables, seq_lens, k_scale, v_scale, scale),)

    return read


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
