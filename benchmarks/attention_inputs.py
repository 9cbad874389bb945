"""Inputs and checks of the attention kernels, shared by their tests and benchmarks.

A packed step laid out as the runtime lays it out (`paged_layout`: scrambled blocks from 1,
block 0 the scratch block that padding writes into, optional padding tokens and sequences,
fixed table and cache sizes as the runner's captured buffers have), random inputs for paged
attention (`make_batch`, `rotary_inputs` for the variant that rotates q and k) and MLA's latent
attention (`make_latent_batch`), and the oracle: `check` / `check_latent` run the kernel and
its reference on copies of the cache and `compare_outputs` fails on any difference in the
written cache or an output error past the dtype's tolerance.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
from torch import Tensor

from compile_engine.kernels_generated.mla_attention import mla_latent_attention_triton
from compile_engine.kernels_generated.paged_attention import (
    paged_attention_rotary_ref,
    paged_attention_triton,
)
from compile_engine.kernels_generated.tuning import KernelConfig
from compile_engine.models.mla import mla_latent_attention_ref
from compile_engine.models.ops import KV_FP8_DTYPE, paged_attention_ref, quantize_kv
from compile_engine.models.rope import cos_sin_table

# --------------------------------------------------------------------------- paged attention


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
    # An FP8 cache's per-tensor scales (float32 scalars); None for a cache of the model dtype.
    k_scale: Tensor | None = None
    v_scale: Tensor | None = None

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
            self.k_scale,
            self.v_scale,
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
    runner's captured buffers do. Shared by the paged and the MLA latent kernels' inputs."""
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
    kv_cache_dtype: torch.dtype | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> PagedBatch:
    """Random q/k/v and cache for sequences laid out by `paged_layout` (same arguments).
    kv_cache_dtype float8_e4m3fn: an FP8 cache of random K/V quantized by `kv_scales` (k, v),
    which the batch carries as its k_scale / v_scale; None: a cache of `dtype`."""
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
    q = randn(num_tokens, num_q_heads, head_dim)
    k = randn(num_tokens, num_kv_heads, head_dim)
    v = randn(num_tokens, num_kv_heads, head_dim)
    kv_cache = randn(*cache_shape)
    k_scale = v_scale = None
    if kv_cache_dtype is not None and kv_cache_dtype != dtype:
        if kv_cache_dtype != KV_FP8_DTYPE:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype}: the model dtype or {KV_FP8_DTYPE}")
        k_scale, v_scale = (torch.tensor(s, dtype=torch.float32, device=device) for s in kv_scales)
        kv_cache = torch.stack(
            [quantize_kv(kv_cache[0], k_scale, kv_cache_dtype),
             quantize_kv(kv_cache[1], v_scale, kv_cache_dtype)]
        )  # fmt: skip
    return PagedBatch(
        q=q,
        k=k,
        v=v,
        kv_cache=kv_cache,
        slot_mapping=layout.slot_mapping,
        block_tables=layout.block_tables,
        seq_lens=layout.seq_lens,
        query_start_loc=layout.query_start_loc,
        scale=1.0 / math.sqrt(head_dim),
        k_scale=k_scale,
        v_scale=v_scale,
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
    kernel_config: KernelConfig | None = None,
) -> dict[str, float]:
    """Run the paged-attention kernel and the reference on copies of the cache; raise
    AssertionError if the outputs or the written caches differ. Returns max abs error and
    cosine similarity. With rot_dim, q and k arrive unrotated (`rotary_inputs`) and the
    kernel rotates them, against `paged_attention_rotary_ref`. kernel_config: the launch
    configs and split policy the kernel runs with (None: the defaults)."""
    cache_ref, cache_out = batch.kv_cache.clone(), batch.kv_cache.clone()
    launch = {"num_splits": num_splits, "tiled": tiled, "kernel_config": kernel_config}
    if rot_dim is None:
        expected = paged_attention_ref(*batch.args(cache_ref))
        got = paged_attention_triton(*batch.args(cache_out), **launch)
    else:
        q, k, v, positions, table = rotary_inputs(batch, rot_dim)
        rest = batch.args()[4:]  # slot_mapping ... scale, k_scale, v_scale
        expected = paged_attention_rotary_ref(q, k, v, cache_ref, *rest, positions, table)
        got = paged_attention_triton(
            q, k, v, cache_out, *rest, positions=positions, cos_sin_cache=table, **launch
        )
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


# --------------------------------------------------------------------------- MLA latent attention


@dataclass(slots=True)
class LatentBatch:
    """One packed step's inputs for the latent op, laid out the way the runtime builds them."""

    q_latent: Tensor
    kv_latent: Tensor
    latent_cache: Tensor
    slot_mapping: Tensor
    block_tables: Tensor
    seq_lens: Tensor
    query_start_loc: Tensor
    kv_lora_rank: int
    scale: float

    def args(self, latent_cache: Tensor | None = None) -> tuple:
        cache = self.latent_cache if latent_cache is None else latent_cache
        return (
            self.q_latent,
            self.kv_latent,
            cache,
            self.slot_mapping,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.kv_lora_rank,
            self.scale,
        )

    def latent_bytes_read(self) -> int:
        """Cache bytes attention reads: every sequence's whole context, once per head block
        (host-side sum of seq_lens: for reporting, never on the launch path)."""
        tokens = int(self.seq_lens.sum())
        return tokens * self.latent_cache.shape[-1] * self.latent_cache.element_size()


def make_latent_batch(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int = 4,
    kv_lora_rank: int = 32,
    rope_dim: int = 16,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    pad_tokens: int = 0,
    pad_seqs: int = 0,
    table_width: int | None = None,
    num_blocks: int | None = None,
    qk_head_dim: int | None = None,
    seed: int = 0,
) -> LatentBatch:
    """Random latent-attention inputs for sequences laid out by `paged_layout` (the same
    layout arguments): H = num_heads query heads of R + P = kv_lora_rank + rope_dim numbers,
    one latent row a token. The scale is that of a query head of qk_head_dim (default R + P)."""
    layout = paged_layout(
        q_lens, seq_lens, block_size=block_size, device=device, pad_tokens=pad_tokens,
        pad_seqs=pad_seqs, table_width=table_width, num_blocks=num_blocks, seed=seed,
    )  # fmt: skip
    num_tokens = layout.num_tokens
    row = kv_lora_rank + rope_dim

    # Drawn on the device: a multi-GB cache drawn on the host would take minutes.
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    return LatentBatch(
        q_latent=randn(num_tokens, num_heads, row),
        kv_latent=randn(num_tokens, row),
        latent_cache=randn(layout.num_blocks, block_size, row),
        slot_mapping=layout.slot_mapping,
        block_tables=layout.block_tables,
        seq_lens=layout.seq_lens,
        query_start_loc=layout.query_start_loc,
        kv_lora_rank=kv_lora_rank,
        scale=1.0 / math.sqrt(qk_head_dim or row),
    )


def check_latent(
    batch: LatentBatch,
    *,
    num_splits: int | None = None,
    atol: float | None = None,
    kernel_config: KernelConfig | None = None,
) -> dict[str, float]:
    """Run the MLA latent kernel and the reference on copies of the cache; raise
    AssertionError if the outputs or the written caches differ. Returns max abs error and
    cosine similarity. kernel_config: the tiles and split policy (None: the defaults)."""
    cache_ref, cache_out = batch.latent_cache.clone(), batch.latent_cache.clone()
    expected = mla_latent_attention_ref(*batch.args(cache_ref))
    got = mla_latent_attention_triton(
        *batch.args(cache_out), num_splits=num_splits, kernel_config=kernel_config
    )
    return compare_outputs(got, expected, (cache_out, cache_ref), "latent cache", atol)
