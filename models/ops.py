"""The engine's op vocabulary: functional ops, each with a plain-PyTorch reference.

Models call these ops and nothing finer-grained, so compiler passes match one node per op
(robust) instead of a soup of aten ops (fragile). Each op is a `torch.library.custom_op` in the
`ce` namespace with a fake implementation, so Dynamo traces it as one opaque node; the
reference is the real implementation on every device until a pass lowers the op to a kernel,
and it is the test oracle for every such lowering.

KV cache layout (one tensor per layer): `[2, num_blocks, block_size, num_kv_heads, head_dim]`,
index 0 keys and 1 values. A token's slot is `block_id * block_size + offset`. Keeping
head_dim innermost and a block's tokens contiguous lets a kernel read one block of one head as
a dense [block_size, head_dim] tile, and lets the reference view the cache as
`[num_blocks * block_size, num_kv_heads, head_dim]` for the write.

FP8 KV cache (`kv_cache_dtype="fp8"`, vLLM's): the cache tensor is float8_e4m3fn and each
attention layer has per-tensor float32 scales `k_scale`, `v_scale` (the checkpoint's, else 1.0):
a write stores `clamp(x / scale, -448, 448)` rounded to e4m3, a read gives `cached * scale`
(`quantize_kv`, `dequantize_kv`). In a cache of the model dtype the scales are not used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.library import custom_op

# --------------------------------------------------------------------------- rms_norm


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # HF's order: normalise in float32, cast back, then scale in the input dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@custom_op("ce::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension. x [..., H], weight [H]."""
    return rms_norm_ref(x, weight, eps)


@rms_norm.register_fake
def rms_norm_fake(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Shared by every kernel lowering of the op (same schema), as for paged_attention."""
    return torch.empty_like(x)


def add_rms_norm_ref(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed


@custom_op("ce::add_rms_norm", mutates_args=())
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual): the pre-norm residual stream in one op."""
    return add_rms_norm_ref(x, residual, weight, eps)


@add_rms_norm.register_fake
def add_rms_norm_fake(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


# --------------------------------------------------------------------------- rotary


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def rotary_ref(
    positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor
) -> tuple[Tensor, Tensor]:
    rot_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, rot_dim / 2] each
    cos = torch.cat([cos, cos], dim=-1)[:, None, :]  # [T, 1, rot_dim]
    sin = torch.cat([sin, sin], dim=-1)[:, None, :]

    def apply(x: Tensor) -> Tensor:
        # HF casts the float32 table to the activation dtype before multiplying.
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        rot, rest = x[..., :rot_dim], x[..., rot_dim:]
        return torch.cat([rot * c + _rotate_half(rot) * s, rest], dim=-1)

    return apply(q), apply(k)


@custom_op("ce::rotary", mutates_args=())
def rotary(positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor) -> tuple[Tensor, Tensor]:
    """Neox-style rotary embedding. positions [T], q [T, Hq, D], k [T, Hkv, D],
    cos_sin_cache [max_pos, rot_dim] (cos half then sin half); dims past rot_dim pass through."""
    return rotary_ref(positions, q, k, cos_sin_cache)


@rotary.register_fake
def rotary_fake(
    positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor
) -> tuple[Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k)


# --------------------------------------------------------------------------- silu_and_mul


def silu_and_mul_ref(x: Tensor) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@custom_op("ce::silu_and_mul", mutates_args=())
def silu_and_mul(x: Tensor) -> Tensor:
    """x [T, 2I] holding [gate | up] -> silu(gate) * up, [T, I]."""
    return silu_and_mul_ref(x)


@silu_and_mul.register_fake
def silu_and_mul_fake(x: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


# --------------------------------------------------------------------------- paged_attention

KV_FP8_DTYPE = torch.float8_e4m3fn  # what kv_cache_dtype "fp8" / "fp8_e4m3" allocates
KV_FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# What kv_cache_dtype takes (vLLM's names): "auto" is the model dtype, "fp8" means e4m3.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for a kv_cache_dtype setting."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return KV_FP8_DTYPE
    raise ValueError(
        f"kv_cache_dtype={kv_cache_dtype!r} is not supported; use one of "
        f"{', '.join(KV_CACHE_DTYPES)}"
    )


def quantize_kv(x: Tensor, scale: Tensor | None, cache_dtype: torch.dtype) -> Tensor:
    """x as a cache of `cache_dtype` stores it: FP8 e4m3 of x / scale (saturated at 448, as
    vLLM's cache write), or x in the cache's dtype (scale unused)."""
    if cache_dtype != KV_FP8_DTYPE:
        return x.to(cache_dtype)
    scaled = x.float() if scale is None else x.float() / scale.float()
    return scaled.clamp(-KV_FP8_MAX, KV_FP8_MAX).to(cache_dtype)


def dequantize_kv(cached: Tensor, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    """What a read of cached K or V gives, in `dtype`: FP8 values times their scale."""
    if cached.dtype != KV_FP8_DTYPE:
        return cached.to(dtype)
    values = cached.float()
    return (values if scale is None else values * scale.float()).to(dtype)


def write_kv_ref(
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    k, v = quantize_kv(k, k_scale, kv_cache.dtype), quantize_kv(v, v_scale, kv_cache.dtype)
    if kv_cache.dtype == KV_FP8_DTYPE:  # index_copy_ has no float8 kernel: copy the bytes
        flat, k, v = flat.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def _gather(cache: Tensor, block_table: Tensor, seq_len: int) -> Tensor:
    """The first seq_len tokens of one sequence: [seq_len, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    return cache[block_table[:num_blocks]].flatten(0, 1)[:seq_len]


def paged_attention_ref(
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
    """Write the new K/V through slot_mapping, then per sequence gather its blocks and run
    masked SDPA. Query i of a sequence with seq_len L and q_len Q sits at position L - Q + i and
    sees keys 0..L-Q+i: causal among the new tokens, full attention to the cached context.
    Rows past query_start_loc[-1] (padding) come out zero. An FP8 cache is written quantized
    by k_scale / v_scale and read dequantized (`quantize_kv`, `dequantize_kv`)."""
    write_kv_ref(k, v, kv_cache, slot_mapping, k_scale, v_scale)
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode, prefill = [], []
    for b in range(len(lens)):
        q_len = starts[b + 1] - starts[b]
        if q_len == 1:
            decode.append(b)
        elif q_len > 1:
            prefill.append(b)
    if decode:
        _decode_batch(q, kv_cache, block_tables, lens, starts, decode, scale, out, k_scale, v_scale)
    for b in prefill:
        start, end, seq_len = starts[b], starts[b + 1], lens[b]
        keys = _gather(kv_cache[0], block_tables[b], seq_len)  # [L, Hkv, D]
        values = _gather(kv_cache[1], block_tables[b], seq_len)
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [Q, L]
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).unsqueeze(0),  # [1, Hq, Q, D]
            dequantize_kv(keys, k_scale, q.dtype).transpose(0, 1).unsqueeze(0),
            dequantize_kv(values, v_scale, q.dtype).transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = o[0].transpose(0, 1)
    return out


def _decode_batch(
    q: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    lens: list[int],
    starts: list[int],
    rows: list[int],
    scale: float,
    out: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """All one-token sequences in one SDPA call: pad their contexts to the longest."""
    block_size = kv_cache.shape[2]
    max_len = max(lens[b] for b in rows)
    num_blocks = -(-max_len // block_size)
    idx = torch.tensor(rows, device=q.device)
    tok = torch.tensor([starts[b] for b in rows], device=q.device)
    tables = block_tables[idx, :num_blocks]  # [B, nb]
    keys = kv_cache[0][tables].flatten(1, 2)[:, :max_len]  # [B, Lmax, Hkv, D]
    values = kv_cache[1][tables].flatten(1, 2)[:, :max_len]
    seq = torch.tensor([lens[b] for b in rows], device=q.device)
    mask = torch.arange(max_len, device=q.device)[None, :] < seq[:, None]  # [B, Lmax]
    o = F.scaled_dot_product_attention(
        q[tok].unsqueeze(2),  # [B, Hq, 1, D]
        dequantize_kv(keys, k_scale, q.dtype).transpose(1, 2),
        dequantize_kv(values, v_scale, q.dtype).transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    out[tok] = o.squeeze(2)


@custom_op("ce::paged_attention", mutates_args=("kv_cache",))
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
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """Attention over a packed batch through a paged KV cache, with the KV write fused.

    q [T, Hq, D]; k, v [T, Hkv, D]; kv_cache [2, N, block_size, Hkv, D] (written in place);
    slot_mapping [T] int64; block_tables [B, max_blocks] int32; seq_lens [B] (context length
    including this step's tokens); query_start_loc [B + 1] (offsets of each sequence's new
    tokens in T); k_scale, v_scale: float32 scalars, an FP8 cache's per-tensor scales (None:
    1.0; models pass their layer's). Returns [T, Hq, D].
    """
    return paged_attention_ref(
        q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
        k_scale, v_scale,
    )  # fmt: skip


@paged_attention.register_fake
def paged_attention_fake(
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
    """Shape of the output; shared by every kernel lowering of the op (same schema)."""
    return torch.empty_like(q)


# The ops of this file; models/vocabulary.py gathers them with the MoE and MLA ops.
OPS = {
    "rms_norm": (rms_norm, rms_norm_ref),
    "add_rms_norm": (add_rms_norm, add_rms_norm_ref),
    "rotary": (rotary, rotary_ref),
    "silu_and_mul": (silu_and_mul, silu_and_mul_ref),
    "paged_attention": (paged_attention, paged_attention_ref),
}

# The ops of this file whose reference reads device values on the host (the sequence lengths);
# models/vocabulary.py gathers every module's.
HOST_SYNC_OPS = frozenset({"paged_attention"})
