"""The CPU decode fast path of paged attention against the reference (models/ops.py): decode
steps of one and several sequences, and a mixed step (which runs the reference itself); the
decode graph's traceable form on decode steps, eager and compiled by Inductor (whose cache
write must land in the cache passed in)."""

from __future__ import annotations

import pytest
import torch

from compile_engine.kernels_generated.paged_attention_cpu import (
    _decode_read,
    decode_read_kernel,
    paged_attention_cpu_impl,
    paged_attention_decode_cpu,
)
from compile_engine.models.ops import paged_attention_ref

BLOCK, HQ, HKV, D, BLOCKS = 16, 6, 2, 32, 24


def batch(q_lens: list[int], ctx: list[int], dtype: torch.dtype, heads=(HQ, HKV, D)):
    hq, hkv, d = heads
    g = torch.Generator().manual_seed(sum(ctx))
    t = sum(q_lens)
    cache = torch.randn(2, BLOCKS, BLOCK, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(BLOCKS - 1, generator=g) + 1  # block 0 is the scratch block
    tables = torch.zeros(len(ctx), 8, dtype=torch.int32)
    slots, used = [], 0
    for b, (q_len, length) in enumerate(zip(q_lens, ctx, strict=True)):
        n = -(-length // BLOCK)
        tables[b, :n] = perm[used : used + n].int()
        used += n
        slots += [
            int(tables[b, p // BLOCK]) * BLOCK + p % BLOCK for p in range(length - q_len, length)
        ]
    starts = torch.tensor([0] + q_lens).cumsum(0).int()
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k, v = (torch.randn(t, hkv, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v, cache, torch.tensor(slots), tables, torch.tensor(ctx, dtype=torch.int32), starts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "q_lens,ctx", [([1], [37]), ([1], [16]), ([1, 1, 1], [5, 40, 17]), ([3, 1], [20, 9])]
)
def test_equals_reference(q_lens, ctx, dtype) -> None:
    q, k, v, cache, slots, tables, lens, starts = batch(q_lens, ctx, dtype)
    want_cache = cache.clone()
    want = paged_attention_ref(q, k, v, want_cache, slots, tables, lens, starts, 0.125)
    ours = paged_attention_cpu_impl(q, k, v, cache, slots, tables, lens, starts, 0.125)
    assert torch.equal(cache, want_cache)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ctx", [[37], [16], [5, 40, 17]])
def test_decode_form_equals_reference(ctx, dtype) -> None:
    q, k, v, cache, slots, tables, lens, starts = batch([1] * len(ctx), ctx, dtype)
    want_cache = cache.clone()
    want = paged_attention_ref(q, k, v, want_cache, slots, tables, lens, starts, 0.125)
    ours = paged_attention_decode_cpu(
        q, k, v, cache, slots, tables, lens, starts, 0.125, None, None, ""
    )
    assert torch.equal(cache, want_cache)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours, want, rtol=tol, atol=tol)


def _cpp_read():
    kernel = decode_read_kernel()
    if kernel is None:
        pytest.skip("the C++ decode read builds on x86 Linux with g++ only (not here)")
    return kernel


@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128), (4, 4, 64)], ids=str)
@pytest.mark.parametrize("ctx", [[37], [5, 40, 17], [16, 1, 90]], ids=str)
def test_cpp_decode_read_equals_reference(heads, ctx) -> None:
    # float32 caches of the head sizes it is built for take the C++ read (csrc/paged_decode_cpu
    # .cpp): each sequence's own keys, against the reference's masked SDPA and the fused read.
    kernel = _cpp_read()
    q, k, v, cache, slots, tables, lens, starts = batch([1] * len(ctx), ctx, torch.float32, heads)
    want_cache = cache.clone()
    want = paged_attention_ref(q, k, v, want_cache, slots, tables, lens, starts, 0.125)
    ours = paged_attention_decode_cpu(
        q, k, v, cache, slots, tables, lens, starts, 0.125, None, None, ""
    )
    assert torch.equal(cache, want_cache)
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)
    fused = _decode_read(q, cache, tables, lens, None, None, 0.125)
    torch.testing.assert_close(kernel(q, cache, tables, lens, 0.125), fused, rtol=1e-5, atol=1e-5)


def test_cpp_decode_read_reads_zeros_for_no_keys_and_refuses_bad_tables() -> None:
    kernel = _cpp_read()
    q, _, _, cache, _, tables, lens, _ = batch([1, 1], [37, 9], torch.float32, (9, 3, 64))
    out = kernel(q, cache, tables, torch.tensor([37, 0], dtype=torch.int32), 0.125)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and out[0].abs().sum() > 0
    bad = tables.clone()
    bad[0, 1] = BLOCKS  # a block id past the cache
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernel(q, cache, bad, lens, 0.125)
    with pytest.raises(RuntimeError, match="not built for head size 64 and 5"):
        q5 = torch.randn(2, 15, 64)
        kernel(q5, cache, tables, lens, 0.125)


def test_decode_form_compiled() -> None:
    compiled = torch.compile(paged_attention_decode_cpu, dynamic=True, fullgraph=True)
    for ctx in ([5, 40, 17], [33, 2]):
        q, k, v, cache, slots, tables, lens, starts = batch([1] * len(ctx), ctx, torch.float32)
        want_cache = cache.clone()
        want = paged_attention_ref(q, k, v, want_cache, slots, tables, lens, starts, 0.125)
        ours = compiled(q, k, v, cache, slots, tables, lens, starts, 0.125, None, None, "")
        assert torch.equal(cache, want_cache)
        torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)


def test_every_layers_decode_read_traces_to_one_shared_subgraph() -> None:
    # AOTAutograd traces the decode graph's attention (passes/paged_attention_cpu.py); each
    # layer's read must become a call of one subgraph, which Inductor compiles once: inlined,
    # 30 copies of the fused reductions cost a cold SmolLM2 start 25-31 s. The cache writes
    # stay in the graph, and the traced graph computes what the eager calls do.
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v, cache, slots, tables, lens, starts = batch([1, 1], [37, 9], torch.float32)

    def two_layers(q, k, v, first, second):
        mid = paged_attention_decode_cpu(
            q, k, v, first, slots, tables, lens, starts, 0.125, None, None, ""
        )
        return paged_attention_decode_cpu(
            mid, k, v, second, slots, tables, lens, starts, 0.125, None, None, ""
        )

    first, second = cache.clone(), cache.clone() * 2
    # Under a tracing context, as AOTAutograd traces: it holds the subgraph cache.
    with torch._guards.tracing(torch._guards.TracingContext(None)):
        gm = make_fx(two_layers)(q, k, v, first.clone(), second.clone())
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert len(calls) == 2
    assert calls[0].args[0].target == calls[1].args[0].target  # one subgraph, called twice
    traced_caches = first.clone(), second.clone()
    torch.testing.assert_close(
        gm(q, k, v, *traced_caches), two_layers(q, k, v, first, second), rtol=0, atol=0
    )
    assert torch.equal(traced_caches[0], first) and torch.equal(traced_caches[1], second)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "q_lens,ctx", [([5], [37]), ([3, 1, 5], [20, 9, 16]), ([16, 2], [40, 2]), ([4], [4])]
)
def test_decode_rows_of_a_verification_step_equal_reference(q_lens, ctx, dtype) -> None:
    # A speculative verification step (1 + k new tokens a sequence) as one row a token
    # (compiler/compiled_model.as_decode_rows) through the decode form equals the reference's
    # causal attention over the same step; the cache gets the same writes.
    from compile_engine.compiler.compiled_model import as_decode_rows
    from compile_engine.models.layers import AttentionMetadata

    q, k, v, cache, slots, tables, lens, starts = batch(q_lens, ctx, dtype)
    want_cache = cache.clone()
    want = paged_attention_ref(q, k, v, want_cache, slots, tables, lens, starts, 0.125)
    rows = as_decode_rows(AttentionMetadata(slots, tables, lens, starts), sum(q_lens))
    assert rows is not None and rows.seq_lens.shape[0] == sum(q_lens)
    ours = paged_attention_decode_cpu(
        q, k, v, cache, rows.slot_mapping, rows.block_tables, rows.seq_lens,
        rows.query_start_loc, 0.125, None, None, "",
    )  # fmt: skip
    assert torch.equal(cache, want_cache)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours, want, rtol=tol, atol=tol)


def test_decode_rows_leave_prompt_chunks_to_the_pieces() -> None:
    from compile_engine.compiler.compiled_model import DECODE_ROWS_MAX_TOKENS, as_decode_rows
    from compile_engine.models.layers import AttentionMetadata

    q_lens = [DECODE_ROWS_MAX_TOKENS + 1, 1]
    _, _, _, _, slots, tables, lens, starts = batch(q_lens, [40, 9], torch.float32)
    assert as_decode_rows(AttentionMetadata(slots, tables, lens, starts), sum(q_lens)) is None
    # Padding past the last sequence's tokens (a graph size): not a step of rows either.
    _, _, _, _, slots, tables, lens, starts = batch([2, 1], [20, 9], torch.float32)
    assert as_decode_rows(AttentionMetadata(slots, tables, lens, starts), 4) is None
