"""The op vocabulary (models/ops.py) against formulations written independently here.

Each op is checked three ways: the registered op equals its own reference; both equal an
oracle that does not share code with them (HF's modules where HF has one, plain dense math
otherwise); and the op survives torch.compile(fullgraph=True, dynamic=True) as exactly one
`torch.ops.ce.<name>` node, which is what the compiler's passes will match.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from compile_engine.models import mla, moe, ops, parallel, quant, vocabulary
from compile_engine.models.rope import cos_sin_table


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)


# --------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_matches_hf(dtype: torch.dtype) -> None:
    hidden, eps = 48, 1e-5
    hf = LlamaRMSNorm(hidden, eps=eps)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.1 * _randn(hidden, seed=1))
    hf = hf.to(dtype)
    x = _randn(7, hidden, dtype=dtype) * 3
    expected = hf(x)
    for impl in (ops.rms_norm, ops.rms_norm_ref):
        got = impl(x, hf.weight, eps)
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_hf(dtype: torch.dtype) -> None:
    hidden, eps = 32, 1e-6
    hf = LlamaRMSNorm(hidden, eps=eps)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.1 * _randn(hidden, seed=2))
    hf = hf.to(dtype)
    x, residual = _randn(5, hidden, dtype=dtype, seed=3), _randn(5, hidden, dtype=dtype, seed=4)
    summed = x + residual
    for impl in (ops.add_rms_norm, ops.add_rms_norm_ref):
        normed, new_residual = impl(x, residual, hf.weight, eps)
        torch.testing.assert_close(new_residual, summed, rtol=0, atol=0)
        torch.testing.assert_close(normed, hf(summed), rtol=0, atol=0)


# --------------------------------------------------------------------------- silu_and_mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype: torch.dtype) -> None:
    gate, up = _randn(6, 40, dtype=dtype, seed=5), _randn(6, 40, dtype=dtype, seed=6)
    expected = F.silu(gate) * up
    x = torch.cat([gate, up], dim=-1)  # [T, 2I]
    for impl in (ops.silu_and_mul, ops.silu_and_mul_ref):
        got = impl(x)
        assert got.shape == (6, 40)
        # Not bitwise: a strided half of x vectorises differently from a contiguous gate.
        torch.testing.assert_close(got, expected)


# --------------------------------------------------------------------------- rotary

ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
    },
}


@pytest.mark.parametrize("rope_type", list(ROPE_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_hf(rope_type: str, dtype: torch.dtype) -> None:
    head_dim, num_heads, num_kv_heads, max_pos = 32, 4, 2, 512
    config = transformers.LlamaConfig(
        hidden_size=head_dim * num_heads,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_pos,
        rope_parameters=dict(ROPE_CASES[rope_type]),
    )
    hf_rope = LlamaRotaryEmbedding(config)
    # Scrambled, repeated and far-apart positions: a packed batch is not one arange.
    positions = torch.tensor([0, 1, 2, 37, 5, 5, 300, 511, 63, 64, 65, 200])
    tokens = positions.numel()
    q = _randn(tokens, num_heads, head_dim, dtype=dtype, seed=7)  # [T, Hq, D]
    k = _randn(tokens, num_kv_heads, head_dim, dtype=dtype, seed=8)  # [T, Hkv, D]

    cos, sin = hf_rope(q, positions[None, :])  # [1, T, D] each, in q's dtype
    # HF's layout is [B, H, T, D]; ours is [T, H, D].
    q_hf, k_hf = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin, unsqueeze_dim=1
    )
    q_hf, k_hf = q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1)

    table = cos_sin_table(config.rope_parameters, head_dim, max_pos)
    tol = {} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    for impl in (ops.rotary, ops.rotary_ref):
        q_out, k_out = impl(positions, q, k, table)
        assert q_out.dtype == dtype and k_out.dtype == dtype
        torch.testing.assert_close(q_out, q_hf, **tol)
        torch.testing.assert_close(k_out, k_hf, **tol)


def test_rotary_partial_dims_pass_through() -> None:
    # rot_dim < head_dim: only the leading rot_dim features rotate (neox layout within them).
    head_dim, rot_dim = 16, 8
    positions = torch.tensor([3, 0, 9])
    q, k = _randn(3, 2, head_dim, seed=9), _randn(3, 1, head_dim, seed=10)
    table = cos_sin_table({"rope_type": "default", "rope_theta": 10000.0}, rot_dim, 16)
    q_out, k_out = ops.rotary(positions, q, k, table)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    angle = positions[:, None].float() * inv_freq[None, :]  # [T, rot_dim / 2]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    for x, out in ((q, q_out), (k, k_out)):
        x1, x2 = x[..., : rot_dim // 2], x[..., rot_dim // 2 : rot_dim]
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        torch.testing.assert_close(out[..., :rot_dim], rotated)
        torch.testing.assert_close(out[..., rot_dim:], x[..., rot_dim:], rtol=0, atol=0)


# --------------------------------------------------------------------------- paged_attention


def dense_causal_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [Q, Hq, D] for the last Q of the L positions in keys/values [L, Hkv, D]."""
    num_q, num_heads = q.shape[:2]
    seq_len, num_kv_heads = keys.shape[:2]
    group = num_heads // num_kv_heads
    keys = keys.repeat_interleave(group, dim=1)  # [L, Hq, D]
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys.double()) * scale  # [Hq, Q, L]
    q_pos = torch.arange(seq_len - num_q, seq_len)[:, None]
    visible = torch.arange(seq_len)[None, :] <= q_pos  # [Q, L]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, values.double()).to(q.dtype)  # [Q, Hq, D]


@st.composite
def paged_batches(draw):
    """A packed batch: per sequence a cached context and some new tokens, a scrambled block
    table over a shared pool, and the head layout."""
    mode = draw(st.sampled_from(["mixed", "decode", "prefill"]))
    num_seqs = draw(st.integers(1, 5))
    seqs = []
    for _ in range(num_seqs):
        if mode == "decode":
            context, new = draw(st.integers(0, 40)), 1
        elif mode == "prefill":
            context, new = 0, draw(st.integers(1, 24))
        else:
            context, new = draw(st.integers(0, 40)), draw(st.integers(1, 12))
        seqs.append((context, new))
    block_size = draw(st.sampled_from([1, 2, 3, 5, 7, 16]))
    num_kv_heads = draw(st.integers(1, 3))
    group = draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([4, 8, 12]))
    spare_blocks = draw(st.integers(0, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    return seqs, block_size, num_kv_heads * group, num_kv_heads, head_dim, spare_blocks, seed


def _run_paged_case(seqs, block_size, num_heads, num_kv_heads, head_dim, spare_blocks, seed):
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    # Garbage everywhere that no sequence owns: large enough that reading a slot the mask
    # should hide shows up, finite so a masked read multiplies out to exactly zero.
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen) * 100
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq)
    tables = torch.randint(0, num_blocks, (len(seqs), width), generator=gen, dtype=torch.int32)

    full_k, full_v, new_q = [], [], []
    q_rows, k_rows, v_rows, slots, starts, seq_lens = [], [], [], [], [0], []
    for b, (context, new) in enumerate(seqs):
        seq_len = context + new
        own = [pool.pop() for _ in range(blocks_per_seq[b])]
        tables[b, : len(own)] = torch.tensor(own, dtype=torch.int32)
        keys = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        values = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        queries = torch.randn(new, num_heads, head_dim, generator=gen)
        for pos in range(context):  # the context a previous step wrote
            cache[0, own[pos // block_size], pos % block_size] = keys[pos]
            cache[1, own[pos // block_size], pos % block_size] = values[pos]
        slots += [
            own[p // block_size] * block_size + p % block_size for p in range(context, seq_len)
        ]
        q_rows.append(queries)
        k_rows.append(keys[context:])
        v_rows.append(values[context:])
        full_k.append(keys)
        full_v.append(values)
        new_q.append(queries)
        starts.append(starts[-1] + new)
        seq_lens.append(seq_len)

    scale = 1 / math.sqrt(head_dim)
    before = cache.clone()
    out = ops.paged_attention(
        torch.cat(q_rows),
        torch.cat(k_rows),
        torch.cat(v_rows),
        cache,
        torch.tensor(slots, dtype=torch.int64),
        tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
        scale,
    )
    assert out.shape == (starts[-1], num_heads, head_dim)

    written = torch.zeros(2, num_blocks, block_size, dtype=torch.bool)
    for b, (context, new) in enumerate(seqs):
        expected = dense_causal_attention(new_q[b], full_k[b], full_v[b], scale)
        torch.testing.assert_close(
            out[starts[b] : starts[b + 1]], expected, rtol=1e-5, atol=1e-5, msg=f"sequence {b}"
        )
        for pos in range(context + new):  # every token's K/V sits at its slot
            block, offset = tables[b, pos // block_size].item(), pos % block_size
            torch.testing.assert_close(cache[0, block, offset], full_k[b][pos], rtol=0, atol=0)
            torch.testing.assert_close(cache[1, block, offset], full_v[b][pos], rtol=0, atol=0)
            written[:, block, offset] = True
    # ... and nothing else in the pool changed.
    torch.testing.assert_close(cache[~written], before[~written], rtol=0, atol=0)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paged_batches())
# Decode-only over block size 1, prefill-only over a non-power-of-two block size, and a mix.
@example(([(5, 1), (0, 1), (17, 1)], 1, 4, 2, 8, 0, 1))
@example(([(0, 9), (0, 1), (0, 14)], 3, 3, 3, 4, 2, 2))
@example(([(16, 1), (3, 7), (0, 12), (31, 1)], 16, 6, 2, 8, 1, 3))
def test_paged_attention_equals_dense_causal(case) -> None:
    _run_paged_case(*case)


def test_paged_attention_reference_is_the_op() -> None:
    # Same case through the op and its reference on twin caches: identical outputs and caches.
    q, k, v = _randn(5, 4, 8, seed=11), _randn(5, 2, 8, seed=12), _randn(5, 2, 8, seed=13)
    cache = _randn(2, 6, 3, 2, 8, seed=14)
    args = (
        torch.tensor([4, 5, 9, 10, 11]),  # seq 0: positions 4, 5 (blocks 1); seq 1: 0..2 (3)
        torch.tensor([[0, 1, 0], [3, 5, 2]], dtype=torch.int32),
        torch.tensor([6, 3], dtype=torch.int32),
        torch.tensor([0, 2, 5], dtype=torch.int32),
        0.35,
    )
    cache_ref = cache.clone()
    out = ops.paged_attention(q, k, v, cache, *args)
    out_ref = ops.paged_attention_ref(q, k, v, cache_ref, *args)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    torch.testing.assert_close(cache, cache_ref, rtol=0, atol=0)


# --------------------------------------------------------------------------- torch.compile


def _compile_case(name: str):
    """(op call, reference call, example args) for op `name`; paged_attention writes args[3]."""
    eps, scale = 1e-5, 0.25
    if name == "rms_norm":
        return (
            lambda x, w: ops.rms_norm(x, w, eps),
            lambda x, w: ops.rms_norm_ref(x, w, eps),
            (_randn(7, 16), _randn(16, seed=1)),
        )
    if name == "add_rms_norm":
        return (
            lambda x, r, w: ops.add_rms_norm(x, r, w, eps),
            lambda x, r, w: ops.add_rms_norm_ref(x, r, w, eps),
            (_randn(7, 16), _randn(7, 16, seed=2), _randn(16, seed=1)),
        )
    if name == "rotary":
        table = cos_sin_table({"rope_type": "default", "rope_theta": 10000.0}, 8, 64)
        positions = torch.tensor([0, 3, 9, 2, 63, 11, 4])
        args = (positions, _randn(7, 4, 8), _randn(7, 2, 8, seed=3), table)
        return ops.rotary, ops.rotary_ref, args
    if name == "silu_and_mul":
        return ops.silu_and_mul, ops.silu_and_mul_ref, (_randn(7, 24),)
    if name == "paged_attention":
        # Block size 4. Sequence 0: a 5-token prefill into blocks [2, 3] (slots 8..12).
        # Sequence 1: one decode token at position 2 over 2 cached tokens in block 1 (slot 6).
        args = (
            _randn(6, 4, 8),
            _randn(6, 2, 8, seed=4),
            _randn(6, 2, 8, seed=5),
            _randn(2, 5, 4, 2, 8, seed=6),
            torch.tensor([8, 9, 10, 11, 12, 6]),
            torch.tensor([[2, 3], [1, 0]], dtype=torch.int32),
            torch.tensor([5, 3], dtype=torch.int32),
            torch.tensor([0, 5, 6], dtype=torch.int32),
        )
        return (
            lambda *a: ops.paged_attention(*a, scale),
            lambda *a: ops.paged_attention_ref(*a, scale),
            args,
        )
    if name in ("mla_attention", "mla_latent_attention"):
        # Latent cache [6 blocks, 3 slots, R 8 + P 4]. Sequence 0: 2 new tokens at positions
        # 4, 5 (block 1); sequence 1: a 3-token prefill into block 3.
        meta = (
            torch.tensor([4, 5, 9, 10, 11]),
            torch.tensor([[0, 1, 0], [3, 5, 2]], dtype=torch.int32),
            torch.tensor([6, 3], dtype=torch.int32),
            torch.tensor([0, 2, 5], dtype=torch.int32),
        )
        latent, cache = _randn(5, 12, seed=21), _randn(6, 3, 12, seed=22)
        if name == "mla_attention":  # q [T, H 2, N 6 + P 4], kv_b_proj [H (N 6 + V 5), R 8]
            args = (_randn(5, 2, 10, seed=23), latent, cache, *meta, _randn(22, 8, seed=24))
            return (
                lambda *a: mla.mla_attention(*a, scale),
                lambda *a: mla.mla_attention_ref(*a, scale),
                args,
            )
        args = (_randn(5, 2, 12, seed=23), latent, cache, *meta)
        return (
            lambda *a: mla.mla_latent_attention(*a, 8, scale),
            lambda *a: mla.mla_latent_attention_ref(*a, 8, scale),
            args,
        )
    if name == "moe_route":  # DeepSeek-V3 style: sigmoid scores, a selection bias, groups
        bias = _randn(8, seed=31)
        return (
            lambda x: moe.moe_route(x, bias, 2, "sigmoid", "noaux_tc", 4, 2, True, 2.5),
            lambda x: moe.moe_route_ref(x, bias, 2, "sigmoid", "noaux_tc", 4, 2, True, 2.5),
            (_randn(5, 8, seed=32),),
        )
    ids = torch.tensor([[0, 2], [2, 3], [1, 0], [3, 3]], dtype=torch.int32)  # [T 4, K 2], E 4
    if name == "moe_align":
        return (
            lambda t: moe.moe_align(t, 4, 2),
            lambda t: moe.moe_align_ref(t, 4, 2),
            (ids,),
        )
    if name == "moe_grouped_gemm":
        sorted_ids, block_expert = moe.moe_align_ref(ids, 4, 2)
        args = (_randn(4, 6, seed=33), _randn(4, 5, 6, seed=34), sorted_ids, block_expert)
        return (
            lambda *a: moe.moe_grouped_gemm(*a, 2),
            lambda *a: moe.moe_grouped_gemm_ref(*a, 2),
            args,
        )
    if name == "moe_combine":
        return moe.moe_combine, moe.moe_combine_ref, (_randn(8, 6, seed=35), _randn(4, 2))
    scheme = str(quant.QuantScheme("channel", "token"))
    weight = (_randn(6, 8, seed=41) * 4).to(torch.float8_e4m3fn)  # [N 6, K 8]
    weight_scale = _randn(6, seed=42).abs() + 0.5
    if name == "quant_linear":
        return (
            lambda x: quant.quant_linear(x, weight, weight_scale, None, None, scheme),
            lambda x: quant.quant_linear_ref(x, weight, weight_scale, None, None, scheme),
            (_randn(5, 8, seed=43),),
        )
    if name == "quantize_fp8":  # dynamic per-token scales: the fp8 values compared as floats
        return (
            lambda x: [t.float() for t in quant.quantize_fp8(x, None)],
            lambda x: [t.float() for t in quant.quantize_fp8_ref(x, None)],
            (_randn(5, 8, seed=44),),
        )
    if name == "dequantize_fp8":
        return (
            lambda q: quant.dequantize_fp8(q, weight_scale, scheme, torch.float32),
            lambda q: quant.dequantize_fp8_ref(q, weight_scale, scheme, torch.float32),
            (weight,),
        )
    if name == "all_reduce_add_rms_norm":  # a group of one rank (the test makes it)
        group = torch.distributed.group.WORLD.group_name
        return (
            lambda x, r, w: parallel.all_reduce_add_rms_norm(x, r, w, 1e-5, group),
            lambda x, r, w: parallel.all_reduce_add_rms_norm_ref(x, r, w, 1e-5, group),
            (_randn(5, 8, seed=45), _randn(5, 8, seed=46), _randn(8, seed=47)),
        )
    raise AssertionError(f"no compile case for op {name}")


@contextlib.contextmanager
def _one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", list(vocabulary.OPS))
def test_op_is_one_node_under_compile(name: str, tmp_path) -> None:
    grouped = name == "all_reduce_add_rms_norm"
    with _one_rank_group(tmp_path) if grouped else contextlib.nullcontext():
        _check_one_node(name)


def _check_one_node(name: str) -> None:
    graphs: list[list] = []  # call targets of each graph, recorded before AOT rewrites it

    def recording_backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    op_call, ref_call, args = _compile_case(name)
    ref_args = [a.clone() for a in args]
    torch._dynamo.reset()
    compiled = torch.compile(op_call, fullgraph=True, dynamic=True, backend=recording_backend)
    torch.testing.assert_close(compiled(*args), ref_call(*ref_args), rtol=0, atol=0)
    # Inputs the op mutates (the KV cache) end up as the reference leaves them.
    for got, want in zip(args, ref_args, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    # fullgraph=True already forbids graph breaks. Dynamo may hand the backend more than one
    # graph: with dynamic=True it first lifts a closed-over float (eps, scale) to a graph
    # input, then retraces with the float specialised (the op's schema takes a Python float).
    # Whatever it hands over, the op must be exactly one node in it.
    assert graphs, "the backend never saw a graph"
    overload = getattr(torch.ops.ce, name).default
    for calls in graphs:
        assert calls.count(overload) == 1, f"{name}: graph calls {[str(c) for c in calls]}"
