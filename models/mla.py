"""Multi-head latent attention (DeepSeek-V2/V3) as ops of the vocabulary, over a paged latent
cache.

MLA compresses each token's keys and values into one latent per token and layer:
`c_kv = kv_a_layernorm(kv_a_proj(x)[:R])` (R = kv_lora_rank) and a rotated key part `k_pe`
(P = qk_rope_head_dim) shared by every head. Head h's key is `[W_UK_h c_kv, k_pe]` and its
value `W_UV_h c_kv`, where `kv_b_proj.weight` stacks, per head, W_UK_h [N, R] (N =
qk_nope_head_dim) over W_UV_h [V, R] (V = v_head_dim). The engine caches only the latent row
`[c_kv | k_pe]`, R + P numbers per token, instead of H (N + P) + H V for up-projected K and V.

Two ops, each with a plain-PyTorch reference:

- `ce::mla_attention` (what the model calls): the naive up-projected form. Write the new
  latents through `slot_mapping`, gather each sequence's latents through its block table,
  up-project them with `kv_b_proj` into per-head K and V, masked causal attention. This is
  HF's computation, and the oracle for every rewrite.
- `ce::mla_latent_attention` (what `passes/mla_absorb.py` rewrites to, with W_UK absorbed
  into the query and W_UV applied after): attention of H query heads against ONE latent "KV
  head" whose key is the whole cached row [R + P] and whose value is its first R numbers.
  Scores `q_nope . (W_UK c) = (W_UK^T q_nope) . c`, so `q_latent = q_nope @ W_UK` [H, R] is
  scored against the cache as it lies; the output `sum_j p_j c_j` [H, R] becomes the head's
  value output through `W_UV`. `mla_attention_absorbed` below is that composition in eager
  PyTorch. The Triton lowering is kernels_generated/mla_attention.py.

Latent cache layout (one tensor per layer): `[num_blocks, block_size, R + P]`, a token's slot
is `block_id * block_size + offset` as for paged_attention, block 0 is the runtime's scratch
(padding tokens write there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.library import custom_op

from compile_engine.models.ops import _gather


class MLAShapeError(ValueError):
    """The tensors handed to an MLA op do not describe one consistent MLA layer."""


def mla_dims(q: Tensor, latent_cache: Tensor, w_kv_b: Tensor) -> tuple[int, int, int, int]:
    """(R, P, N, V) read off the shapes: kv_b_proj.weight is [H (N + V), R], the cache row is
    R + P wide, the query N + P."""
    num_heads, qk_dim = q.shape[1], q.shape[2]
    rank = w_kv_b.shape[1]
    rope = latent_cache.shape[-1] - rank
    nope = qk_dim - rope
    if rope <= 0 or nope <= 0 or w_kv_b.shape[0] % num_heads:
        raise MLAShapeError(
            f"q {tuple(q.shape)}, latent cache {tuple(latent_cache.shape)} and kv_b_proj weight "
            f"{tuple(w_kv_b.shape)} do not describe one MLA layer (want q [T, H, N + P], cache "
            "[blocks, block_size, R + P], weight [H (N + V), R])"
        )
    v_dim = w_kv_b.shape[0] // num_heads - nope
    if v_dim <= 0:
        raise MLAShapeError(f"kv_b_proj weight {tuple(w_kv_b.shape)} leaves no value dims")
    return rank, rope, nope, v_dim


def write_latent_ref(kv_latent: Tensor, latent_cache: Tensor, slot_mapping: Tensor) -> None:
    num_blocks, block_size, width = latent_cache.shape
    flat = latent_cache.view(num_blocks * block_size, width)
    flat.index_copy_(0, slot_mapping, kv_latent.to(latent_cache.dtype))


def _causal_mask(seq_len: int, q_len: int, device: torch.device) -> Tensor:
    """[Q, L]: query i sits at position L - Q + i and sees keys 0..that position."""
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
    return torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]


def _sequences(seq_lens: Tensor, query_start_loc: Tensor) -> list[tuple[int, int, int, int]]:
    """(row, first token, last token + 1, seq_len) of every sequence with new tokens. A host
    read: the references cannot be captured in a CUDA graph, their kernel lowerings can."""
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    return [
        (b, starts[b], starts[b + 1], lens[b])
        for b in range(len(lens))
        if starts[b + 1] > starts[b]
    ]


# --------------------------------------------------------------------------- mla_attention


def mla_attention_ref(
    q: Tensor,
    kv_latent: Tensor,
    latent_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    w_kv_b: Tensor,
    scale: float,
) -> Tensor:
    """The naive up-projected form (HF's): per sequence, gather its latents, up-project them
    with kv_b_proj into K_nope and V for every head, append the shared rotated k_pe to each
    head's key, masked SDPA. Rows past query_start_loc[-1] (padding) come out zero."""
    rank, rope, nope, v_dim = mla_dims(q, latent_cache, w_kv_b)
    num_heads = q.shape[1]
    write_latent_ref(kv_latent, latent_cache, slot_mapping)
    out = q.new_zeros(q.shape[0], num_heads, v_dim)
    for b, start, end, seq_len in _sequences(seq_lens, query_start_loc):
        latent = _gather(latent_cache, block_tables[b], seq_len).to(q.dtype)  # [L, R + P]
        c_kv, k_pe = latent.split([rank, rope], dim=-1)
        kv = F.linear(c_kv, w_kv_b).view(seq_len, num_heads, nope + v_dim)  # [L, H, N + V]
        k_nope, v = kv.split([nope, v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, num_heads, -1)], dim=-1)  # [L, H, N+P]
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).unsqueeze(0),  # [1, H, Q, N + P]
            k.transpose(0, 1).unsqueeze(0),  # [1, H, L, N + P]
            v.transpose(0, 1).unsqueeze(0),  # [1, H, L, V]
            attn_mask=_causal_mask(seq_len, end - start, q.device),
            scale=scale,
        )
        out[start:end] = o[0].transpose(0, 1)
    return out


@custom_op("ce::mla_attention", mutates_args=("latent_cache",))
def mla_attention(
    q: Tensor,
    kv_latent: Tensor,
    latent_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    w_kv_b: Tensor,
    scale: float,
) -> Tensor:
    """Multi-head latent attention over a packed batch through a paged latent cache, with the
    latent write fused.

    q [T, H, N + P] (the rope part last, rotated); kv_latent [T, R + P] (kv_a_layernorm(c_kv)
    then the rotated k_pe); latent_cache [num_blocks, block_size, R + P] (written in place);
    slot_mapping, block_tables, seq_lens, query_start_loc as for paged_attention; w_kv_b the
    kv_b_proj weight [H (N + V), R]. Returns [T, H, V]. R, P, N, V are read off the shapes.
    """
    return mla_attention_ref(
        q, kv_latent, latent_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
        w_kv_b, scale,
    )  # fmt: skip


@mla_attention.register_fake
def _(
    q: Tensor,
    kv_latent: Tensor,
    latent_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    w_kv_b: Tensor,
    scale: float,
) -> Tensor:
    _, _, _, v_dim = mla_dims(q, latent_cache, w_kv_b)
    return q.new_empty(q.shape[0], q.shape[1], v_dim)


# --------------------------------------------------------------------------- mla_latent_attention


def mla_latent_attention_ref(
    q_latent: Tensor,
    kv_latent: Tensor,
    latent_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    kv_lora_rank: int,
    scale: float,
) -> Tensor:
    """Attention of H query heads against the cached latent rows as one shared KV head: key =
    the whole row [R + P], value = its first R numbers. Returns [T, H, R], zero for padding."""
    write_latent_ref(kv_latent, latent_cache, slot_mapping)
    out = q_latent.new_zeros(q_latent.shape[0], q_latent.shape[1], kv_lora_rank)
    for b, start, end, seq_len in _sequences(seq_lens, query_start_loc):
        latent = _gather(latent_cache, block_tables[b], seq_len).to(q_latent.dtype)  # [L, R+P]
        o = F.scaled_dot_product_attention(
            q_latent[start:end].transpose(0, 1).unsqueeze(0),  # [1, H, Q, R + P]
            latent[None, None],  # [1, 1, L, R + P]
            latent[None, None, :, :kv_lora_rank],  # [1, 1, L, R]
            attn_mask=_causal_mask(seq_len, end - start, q_latent.device),
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = o[0].transpose(0, 1)
    return out


@custom_op("ce::mla_latent_attention", mutates_args=("latent_cache",))
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
) -> Tensor:
    """The absorbed core of MLA. q_latent [T, H, R + P] (q_nope @ W_UK, then the rotated
    q_pe); kv_latent, latent_cache, slot_mapping, block_tables, seq_lens, query_start_loc as
    for mla_attention. Returns the attention-weighted latents [T, H, R]."""
    return mla_latent_attention_ref(
        q_latent, kv_latent, latent_cache, slot_mapping, block_tables, seq_lens,
        query_start_loc, kv_lora_rank, scale,
    )  # fmt: skip


@mla_latent_attention.register_fake
def mla_latent_attention_fake(
    q_latent: Tensor,
    kv_latent: Tensor,
    latent_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    kv_lora_rank: int,
    scale: float,
) -> Tensor:
    """Shape of the output; shared by every kernel lowering of the op (same schema)."""
    return q_latent.new_empty(q_latent.shape[0], q_latent.shape[1], kv_lora_rank)


# --------------------------------------------------------------------------- the absorbed form


def split_kv_b(w_kv_b: Tensor, num_heads: int, nope: int, v_dim: int) -> tuple[Tensor, Tensor]:
    """kv_b_proj.weight [H (N + V), R] -> (W_UK [H, N, R], W_UV [H, V, R]), views."""
    w = w_kv_b.view(num_heads, nope + v_dim, w_kv_b.shape[1])
    return w[:, :nope], w[:, nope:]


def mla_attention_absorbed(
    q: Tensor,
    kv_latent: Tensor,
    latent_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    w_kv_b: Tensor,
    scale: float,
    latent_attention=mla_latent_attention_ref,
) -> Tensor:
    """`mla_attention` computed in the weight-absorbed form, the composition the MLA pass
    writes into the graph: W_UK into the query, latent attention, W_UV on the output."""
    rank, rope, nope, v_dim = mla_dims(q, latent_cache, w_kv_b)
    w_uk, w_uv = split_kv_b(w_kv_b, q.shape[1], nope, v_dim)
    q_nope, q_pe = q.split([nope, rope], dim=-1)
    q_latent = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe], dim=-1)  # [T,H,R+P]
    o_latent = latent_attention(
        q_latent, kv_latent, latent_cache, slot_mapping, block_tables, seq_lens,
        query_start_loc, rank, scale,
    )  # fmt: skip
    return torch.einsum("thr,hvr->thv", o_latent, w_uv)  # [T, H, V]


def kv_bytes_per_token(
    *,
    num_layers: int,
    num_heads: int,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    element_size: int,
) -> dict[str, int]:
    """KV cache bytes one token costs across all layers: the latent row this engine caches
    against the up-projected K and V a naive cache would hold."""
    latent = kv_lora_rank + qk_rope_head_dim
    naive = num_heads * (qk_nope_head_dim + qk_rope_head_dim) + num_heads * v_head_dim
    return {
        "latent_bytes_per_token": num_layers * latent * element_size,
        "naive_bytes_per_token": num_layers * naive * element_size,
        "latent_numbers_per_token_layer": latent,
        "naive_numbers_per_token_layer": naive,
    }


MLA_OPS = {
    "mla_attention": (mla_attention, mla_attention_ref),
    "mla_latent_attention": (mla_latent_attention, mla_latent_attention_ref),
}
HOST_SYNC_OPS = frozenset(MLA_OPS)  # both references walk the sequences on the host
