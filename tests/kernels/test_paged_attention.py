"""The Triton paged-attention kernel against `models.ops.paged_attention_ref`.

CPU cases run under the Triton interpreter, which is switched on by TRITON_INTERPRET=1 read
when `triton.jit` wraps a function, triton's own standard library included (at `import
triton`). Setting the variable inside this process would therefore have to happen before
anything imports triton, and would leak into every later test module of the session: on the
GPU machine Inductor's kernels would turn into interpreted Python. So this process never sets
it: `test_interpreter_cases_in_subprocess` runs the CPU cases of this file in a child pytest
whose environment sets TRITON_INTERPRET=1 from its start. In that child, or in a session
started with TRITON_INTERPRET=1, the CPU cases run in-process.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compile_engine.benchmarks import attention_inputs as ai
from compile_engine.kernels_generated import paged_attention as pa
from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.counters import ALLOCATED
from compile_engine.kernels_generated.device import CPU_SM_COUNT
from compile_engine.kernels_generated.paged_attention import launch
from compile_engine.kernels_generated.tuning import AttentionTuning, KernelConfig
from compile_engine.models.ops import paged_attention_ref

REPO_ROOT = Path(__file__).resolve().parents[2]

# CPU cases run in the TRITON_INTERPRET=1 child; the parent deselects them (tests/conftest.py).
interpreted = pytest.mark.interpreted_child("TRITON_INTERPRET")
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or pa.INTERPRETED,
    reason="needs CUDA (and compiled, not interpreted, Triton)",
)

# (q_lens, seq_lens, extra make_batch arguments). seq_len counts the step's new tokens.
CASES = {
    "decode": ([1, 1, 1, 1], [9, 17, 1, 40], {}),
    "prefill": ([5, 7], [5, 7], {}),
    "chunked_prefill": ([4, 3], [13, 30], {}),
    "mixed": ([1, 6, 1, 3], [21, 6, 44, 13], {}),
    "gqa_group4": ([1, 4, 1], [30, 9, 3], {"num_q_heads": 8}),
    "mha": ([2, 1], [11, 35], {"num_q_heads": 2}),
    # Padded as the runner pads to a captured size: spare table columns and blocks too.
    "padded": ([1, 3, 1], [25, 3, 41], {"pad_tokens": 3, "pad_seqs": 2, "spare_blocks": 3}),
    "empty_seq_between": ([2, 0, 1], [2, 5, 38], {}),
}


KEY = tuning.default().key  # the ops' last argument: the kernel config the pass gives them


def _attention(tier: dict | None = None, **fields) -> KernelConfig:
    """A kernel config whose attention tuning differs from the default by `fields`, and its
    CPU decode config by `tier`."""
    default = AttentionTuning()
    [cpu] = default.decode_cpu
    decode_cpu = (dataclasses.replace(cpu, **(tier or {})),)
    return KernelConfig(attention=dataclasses.replace(default, decode_cpu=decode_cpu, **fields))


def _batch(name: str, block_size: int, dtype: torch.dtype, seed: int = 0) -> ai.PagedBatch:
    q_lens, seq_lens, extra = CASES[name]
    extra = dict(extra)
    if spare := extra.pop("spare_blocks", 0):
        blocks = [-(-n // block_size) for n in seq_lens]
        extra.update(table_width=max(blocks) + spare, num_blocks=1 + sum(blocks) + spare)
    # Two head sizes: 32 in half precision, 16 in float32.
    head_dim = 32 if dtype == torch.float16 else 16
    return ai.make_batch(
        q_lens,
        seq_lens,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=seed,
        **{"num_q_heads": 4, **extra},
    )


# --------------------------------------------------------------------------- CPU (interpreter)


# Block sizes 1 and 3 (a block per token, and one that no power-of-two shape divides); 4 and 16
# run in the tiled cases below. The interpreter runs ~1.5 ms a program: this grid is most of the
# CPU suite's single longest test, so each dtype runs at one block size (the kernel's dtype
# handling is the same at every block size; fp16 takes the one no power of two divides).
FP32_BLOCK1, FP16_BLOCK3 = (1, torch.float32), (3, torch.float16)


@interpreted
@pytest.mark.parametrize("num_splits", [1, 3], ids=["single", "split3"])
@pytest.mark.parametrize(
    ("block_size", "dtype"), [FP32_BLOCK1, FP16_BLOCK3], ids=["1-fp32", "3-fp16"]
)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case: str, block_size: int, dtype: torch.dtype, num_splits: int):
    batch = _batch(case, block_size, dtype, seed=block_size)
    atol = 1e-4 if dtype == torch.float32 else 2e-3
    # check() also compares the KV cache written by the kernel with the reference's.
    ai.check(batch, num_splits=num_splits, atol=atol)


@interpreted
def test_padding_tokens_are_zero_and_real_tokens_unaffected():
    batch = _batch("padded", 3, torch.float32)
    out = pa.paged_attention_triton(*batch.args(batch.kv_cache.clone()), num_splits=2)
    real = int(batch.query_start_loc[-1])
    assert torch.equal(out[real:], torch.zeros_like(out[real:]))
    assert out[:real].abs().sum() > 0


@interpreted
def test_split_partials_cover_many_splits():
    # More splits than BLOCK_N-sized chunks of the shortest context: empty splits must drop out.
    batch = ai.make_batch([1, 1], [70, 2], block_size=3)
    for num_splits in (2, 5, 8):
        ai.check(batch, num_splits=num_splits)


@interpreted
@pytest.mark.parametrize(
    "fields, tier",
    [
        ({"combine_splits": 2}, {}),
        ({}, {"min_split_keys": 32}),
        ({}, {"block_n": 32}),
        ({}, {"maxnreg": 128}),  # a register cap launches (the interpreter ignores it)
    ],
    ids=["combine-2", "min-split-32", "block-32", "maxnreg"],
)
def test_decode_variants(fields: dict, tier: dict):
    # The splits the combining program loads a step, the keys a split takes at least, the key
    # tile, a register cap, from the kernel config: every variant matches the reference, with
    # padding, an empty sequence between, and sequences shorter and longer than a split.
    config = _attention(tier, **fields)
    batch = ai.make_batch(
        [1, 6, 0, 1, 1], [21, 6, 4, 44, 70], num_q_heads=8, num_kv_heads=2, block_size=3,
        pad_tokens=2, pad_seqs=1,
    )  # fmt: skip
    for num_splits in (1, 5, None):
        ai.check(batch, num_splits=num_splits, kernel_config=config)


@interpreted
def test_verification_rows_attend_as_one_token_decodes_bit_for_bit():
    # Lossless greedy speculation in bf16 (issue 33): the CUDA-graph runner runs a verification
    # step (1 + k tokens of one sequence) as one-token rows over the sequence's table
    # (`as_decode_rows`), written first (write_first), so each row reads the step's earlier
    # tokens from the cache as the one-token decode of its token does and comes out the same
    # bits; a sequence of <= unsplit_keys keys takes one split in a wider table with an
    # unsplit launch's arithmetic. fp32, so any reordering shows; the cache matches the
    # reference's too.
    from compile_engine.compiler.compiled_model import as_decode_rows
    from compile_engine.models.layers import AttentionMetadata

    config = _attention({"unsplit_keys": 48})
    for context, splits in ((70, 4), (40, 4), (40, 1)):
        step = ai.make_batch([5], [context], block_size=4, table_width=24, seed=context)
        meta = AttentionMetadata(
            step.slot_mapping, step.block_tables, step.seq_lens, step.query_start_loc
        )
        rows = as_decode_rows(meta, 5)
        as_rows = dataclasses.replace(
            step, block_tables=rows.block_tables, seq_lens=rows.seq_lens,
            query_start_loc=rows.query_start_loc,
        )  # fmt: skip
        cache = step.kv_cache.clone()
        got = pa.paged_attention_triton(
            *as_rows.args(cache), num_splits=splits, kernel_config=config, write_first=True
        )
        want_cache = step.kv_cache.clone()
        want = paged_attention_ref(*step.args(want_cache)[:9])
        assert torch.equal(cache, want_cache)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        for i in range(5):
            one = slice(i, i + 1)
            decode = dataclasses.replace(
                as_rows, q=step.q[one], k=step.k[one], v=step.v[one],
                slot_mapping=step.slot_mapping[one], block_tables=rows.block_tables[one],
                seq_lens=rows.seq_lens[one], query_start_loc=torch.tensor([0, 1]).int(),
            )  # fmt: skip
            # A short sequence takes one split in a wide table: the unsplit launch's bits.
            alone = 1 if context - 4 + i <= 48 else splits
            out = pa.paged_attention_triton(
                *decode.args(cache.clone()), num_splits=alone, kernel_config=config
            )
            assert torch.equal(out[0], got[i]), (context, splits, i)


@interpreted
def test_fused_split_reduce_leaves_counters_zero():
    # The program that combines a (token, head group)'s splits zeroes its counter again, so
    # the next launch (the next layer, a graph replay) finds every counter at zero.
    batch = ai.make_batch([1, 1], [70, 40], block_size=4)
    first = pa.paged_attention_triton(*batch.args(batch.kv_cache.clone()), num_splits=4)
    counters = ALLOCATED[("paged_attention", batch.q.device)]
    assert int(counters.abs().sum()) == 0
    second = pa.paged_attention_triton(*batch.args(batch.kv_cache.clone()), num_splits=4)
    assert torch.equal(first, second)


@interpreted
def test_custom_op_matches_reference_and_mutates_cache():
    batch = _batch("mixed", 4, torch.float32)
    cache_ref, cache_op = batch.kv_cache.clone(), batch.kv_cache.clone()
    expected = paged_attention_ref(*batch.args(cache_ref))
    got = torch.ops.ce_kernels.paged_attention(*batch.args(cache_op), KEY)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(cache_op, cache_ref)


@interpreted
def test_custom_op_traces_as_one_node():
    # The op must sit in an FX graph as one opaque call with the cache mutation kept.
    batch = _batch("decode", 4, torch.float32)

    def step(*args):
        return torch.ops.ce_kernels.paged_attention(*args, KEY) * 2

    cache_ref, cache_op = batch.kv_cache.clone(), batch.kv_cache.clone()
    expected = paged_attention_ref(*batch.args(cache_ref)) * 2
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*batch.args(cache_op)), expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(cache_op, cache_ref)


# Rotary applied by the kernel (the rotary_into_attention pass): q and k arrive unrotated as
# views of a packed QKV tensor; the output and the rotated keys written to the cache must
# match ce::rotary then the reference attention. Modes: the single-token kernel, split-KV and
# the tiled prefill variant (with its per-sequence decode launch).
ROTARY_MODES = {"single": {"num_splits": 1}, "split3": {"num_splits": 3}, "tiled": {"tiled": True}}


@interpreted
@pytest.mark.parametrize("mode", list(ROTARY_MODES))
@pytest.mark.parametrize("case", list(CASES))
def test_rotary_matches_reference(case: str, mode: str):
    # float16: the kernel rounds each product and the sum as the reference's fp16 ops do.
    batch = _batch(case, 4, torch.float16, seed=11)
    ai.check(batch, rot_dim=batch.q.shape[-1], atol=2e-3, **ROTARY_MODES[mode])


@interpreted
@pytest.mark.parametrize("mode", list(ROTARY_MODES))
@pytest.mark.parametrize("case", ["mixed", "padded"])
def test_rotary_partial_width_matches_reference(case: str, mode: str):
    # rot_dim < head_dim (e.g. GPT-NeoX style partial rotary): columns past it pass through.
    batch = _batch(case, 3, torch.float32, seed=5)
    ai.check(batch, rot_dim=batch.q.shape[-1] // 2, **ROTARY_MODES[mode])


@interpreted
def test_rotary_custom_op_matches_reference_and_mutates_cache():
    batch = _batch("chunked_prefill", 4, torch.float32)
    q, k, v, positions, table = ai.rotary_inputs(batch, batch.q.shape[-1])
    rest = batch.args()[4:]
    cache_ref, cache_op = batch.kv_cache.clone(), batch.kv_cache.clone()
    expected = pa.paged_attention_rotary_ref(q, k, v, cache_ref, *rest, positions, table)
    got = torch.ops.ce_kernels.paged_attention_rotary(
        q, k, v, cache_op, *rest, positions, table, KEY
    )
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(cache_op, cache_ref)


def test_rotary_inputs_are_checked():
    batch = _batch("decode", 4, torch.float32)
    q, k, v, positions, table = ai.rotary_inputs(batch, batch.q.shape[-1])
    rest = batch.args()[4:]
    with pytest.raises(pa.PagedAttentionKernelError, match="both positions and cos_sin_cache"):
        pa.paged_attention_triton(q, k, v, batch.kv_cache, *rest, positions=positions)
    with pytest.raises(pa.PagedAttentionKernelError, match="even rot_dim"):
        pa.paged_attention_triton(
            q, k, v, batch.kv_cache, *rest, positions=positions, cos_sin_cache=table[:, :3]
        )
    with pytest.raises(pa.PagedAttentionKernelError, match="positions must be integers"):
        pa.paged_attention_triton(
            q, k, v, batch.kv_cache, *rest, positions=positions[:1], cos_sin_cache=table
        )


# The query-tiled prefill variant (tiled=True). Chunk lengths 5, 19 and 17 are not multiples
# of BLOCK_M (16 for group 1, 4 for group 4 on CPU); chunks with context, decodes, an empty
# sequence, padding tokens and padding sequences share one batch.
TILED_Q_LENS = [5, 1, 19, 0, 1, 17]
TILED_SEQ_LENS = [12, 9, 19, 2, 30, 50]


@interpreted
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize(
    ("block_size", "dtype"),
    [(1, torch.float16), (4, torch.float32), (16, torch.float16)],
    ids=["1-fp16", "4-fp32", "16-fp16"],
)  # each block size once, both dtypes (the interpreter's time: see test_matches_reference)
def test_tiled_matches_reference(block_size: int, dtype: torch.dtype, group: int):
    batch = ai.make_batch(
        TILED_Q_LENS,
        TILED_SEQ_LENS,
        num_q_heads=2 * group,
        num_kv_heads=2,
        head_dim=32 if dtype == torch.float16 else 16,
        block_size=block_size,
        dtype=dtype,
        pad_tokens=3,
        pad_seqs=2,
        seed=block_size + group,
    )
    atol = 1e-4 if dtype == torch.float32 else 2e-3
    # check() also compares the KV cache written by the kernel (padding into block 0).
    ai.check(batch, tiled=True, atol=atol)
    out = pa.paged_attention_triton(*batch.args(batch.kv_cache.clone()), tiled=True)
    real = int(batch.query_start_loc[-1])
    assert torch.equal(out[real:], torch.zeros_like(out[real:]))


@interpreted
def test_tiled_chosen_by_shapes_in_the_op(monkeypatch: pytest.MonkeyPatch):
    # The custom op the engine calls takes the tiled variant for a prefill-heavy batch (15
    # tokens for 2 sequences), unless its kernel config asks for more tokens a sequence; an
    # explicit num_splits runs the single-token kernel.
    batch = ai.make_batch([6, 9], [6, 20], block_size=4)
    launched = []
    launch_tiled = launch._launch_tiled
    monkeypatch.setattr(
        launch, "_launch_tiled", lambda *a, **kw: launched.append(a[-1]) or launch_tiled(*a, **kw)
    )
    cache_ref, cache_op = batch.kv_cache.clone(), batch.kv_cache.clone()
    expected = paged_attention_ref(*batch.args(cache_ref))
    got = torch.ops.ce_kernels.paged_attention(*batch.args(cache_op), KEY)
    assert launched == [tuning.default()]  # with the config the key names
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(cache_op, cache_ref)
    pa.paged_attention_triton(*batch.args(cache_op), num_splits=1)  # explicit: untiled
    untiled = _attention(tiled_min_tokens_per_seq=8)  # 7.5 tokens a sequence: too few
    got = torch.ops.ce_kernels.paged_attention(*batch.args(batch.kv_cache.clone()), untiled.key)
    assert len(launched) == 1
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


# The tiled variant with its tiles' cached keys split: each split takes at least one key (the
# CPU's BLOCK_N, 16, rounds a share up), so the chunks after 65 and 73 cached keys run 2-5
# active splits whose last also takes the chunk's own keys causally, the first chunk (no
# cached keys) one; decodes ride the single-token launch; padding tokens and sequences too.
@interpreted
@pytest.mark.parametrize(("kv", "num_splits"), [("auto", 5), ("fp8", 2)])
def test_tiled_splits_match_reference(kv: str, num_splits: int):
    fp8 = {"kv_cache_dtype": torch.float8_e4m3fn, "kv_scales": (0.05, 0.02)} if kv == "fp8" else {}
    batch = ai.make_batch(
        [5, 1, 19, 17], [70, 9, 19, 90], num_q_heads=8, num_kv_heads=2, head_dim=16,
        block_size=4, pad_tokens=3, pad_seqs=2, seed=num_splits, **fp8,
    )  # fmt: skip
    config = _attention(tiled_min_split_keys=1)
    for _ in range(2):  # the arrival counters are zero again after a launch
        ai.check(batch, tiled=True, num_splits=num_splits, kernel_config=config, atol=1e-4)


@interpreted
def test_tiled_refuses_no_splits():
    batch = ai.make_batch([3], [9])
    with pytest.raises(pa.PagedAttentionKernelError, match="num_splits must be >= 1"):
        pa.paged_attention_triton(*batch.args(), tiled=True, num_splits=0)


def test_tiled_splits_from_the_programs_its_tokens_fill():
    # CPU_SM_COUNT (8) "SMs": 16 tokens in 16-token tiles x 2 KV heads are 2 programs, split
    # to two an SM within the keys the table holds; 64 tokens x 2 heads fill the SMs.
    cpu = torch.device("cpu")
    default = tuning.default()
    assert default.attention.tiled_min_split_keys == 256
    assert pa.tiled_num_splits(default, 16, 16, 2, 1 << 20, cpu) == 8
    assert pa.tiled_num_splits(default, 16, 16, 2, 512, cpu) == 2  # 256 keys a split at least
    assert pa.tiled_num_splits(default, 64, 16, 2, 1 << 20, cpu) == 1
    assert pa.tiled_num_splits(default, 16, 16, 2, 256, cpu) == 1


# --------------------------------------------------------------------------- anywhere


def test_choose_tiled_by_shapes_and_the_configs_threshold():
    default = tuning.default()
    assert default.attention.tiled_min_tokens_per_seq == 2
    assert pa.choose_tiled(default, 2048, 4) is True  # prefill-heavy shapes
    assert pa.choose_tiled(default, 8, 4) is True  # two tokens a sequence slot
    assert pa.choose_tiled(default, 7, 4) is False
    assert pa.choose_tiled(default, 256, 256) is False  # decode shapes: never tiled
    strict = _attention(tiled_min_tokens_per_seq=1024)
    assert pa.choose_tiled(strict, 2048, 4) is False
    assert pa.choose_tiled(strict, 4096, 4) is True


def test_choose_num_splits_reads_shapes_only():
    cpu = torch.device("cpu")
    sms = CPU_SM_COUNT
    default = tuning.default()
    assert pa.choose_num_splits(default, sms, 1, 32768, cpu) == 1  # enough programs already
    assert pa.choose_num_splits(default, 1, 2, 32768, cpu) > 1  # one long decode: split
    assert pa.choose_num_splits(default, 1, 2, 16, cpu) == 1  # short context: nothing to split
    assert pa.choose_num_splits(default, 1, 1, 10**7, cpu) <= default.attention.max_splits
    assert pa.choose_num_splits(default, 1, 1, 10**7, cpu) == 2 * sms  # two programs an SM
    assert pa.choose_num_splits(_attention(max_splits=4), 1, 1, 10**7, cpu) == 4  # the cap


def test_decode_configs_by_launch_size():
    # The last tier whose `least` the launch reaches: on CUDA the small-batch config with
    # the unsplit table for 1-16 tokens (verification steps attend as decodes do), BLOCK_N 32
    # from 17, the register cap from 100; one config on CPU (the interpreter).
    attention = tuning.default().attention
    assert [attention.decode(n, "cuda").least for n in (0, 1, 2, 16, 17, 99, 100, 4096)] == [
        1, 1, 1, 1, 17, 17, 100, 100
    ]  # fmt: skip
    assert attention.decode(1, "cuda").unsplit_keys == 160
    assert attention.decode(16, "cuda").unsplit_keys == 160
    assert attention.decode(17, "cuda").unsplit_keys == 0
    assert attention.decode(256, "cuda").maxnreg == 128
    assert attention.decode(64, "cuda").maxnreg is None
    assert attention.decode(256, "cpu") == attention.decode_cpu[0]


def test_unsplit_context():
    # A table at most unsplit_keys keys wide takes one split, a wider one splits as before;
    # `unsplit_context` names that width only for launches that would split a wide table.
    cpu = torch.device("cpu")
    default = tuning.default()
    assert pa.unsplit_context(default, 1, 2, cpu) == 0  # the CPU config sets none
    config = _attention({"unsplit_keys": 48})
    assert pa.choose_num_splits(config, 1, 2, 48, cpu) == 1
    assert pa.choose_num_splits(config, 1, 2, 64, cpu) == 4  # 64 keys, 16 a split
    assert pa.choose_num_splits(config, 1, 2, 32768, cpu) > 1
    assert pa.unsplit_context(config, 1, 2, cpu) == 48
    assert pa.unsplit_context(config, CPU_SM_COUNT, 1, cpu) == 0  # enough programs: never splits
    # The CUDA tiers: one token unsplit on a table of <= 160 keys (the H200's 132 SMs).
    cuda = torch.device("cuda")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launch, "sm_count", lambda device: 132)
        assert pa.unsplit_context(default, 1, 8, cuda) == 160
        assert pa.unsplit_context(default, 16, 8, cuda) == 160
        assert pa.unsplit_context(default, 17, 8, cuda) == 0
        # 1-16 tokens split as one token does (a verification step as its decodes), from 17
        # by the programs their tokens fill.
        one = pa.choose_num_splits(default, 1, 8, 32768, cuda)
        assert [pa.choose_num_splits(default, t, 8, 32768, cuda) for t in (2, 8, 16)] == [one] * 3
        assert pa.choose_num_splits(default, 17, 8, 32768, cuda) < one


def test_rejects_unsupported_head_dim():
    batch = ai.make_batch([1], [3], head_dim=16)
    q = torch.zeros(1, 4, 24)
    k = v = torch.zeros(1, 2, 24)
    cache = torch.zeros(2, 2, 4, 2, 24)
    with pytest.raises(pa.PagedAttentionKernelError, match="head_dim 24"):
        pa.paged_attention_triton(
            q, k, v, cache, batch.slot_mapping, batch.block_tables, batch.seq_lens,
            batch.query_start_loc, 1.0,
        )  # fmt: skip


# FP8 KV cache (kv_cache_dtype "fp8"): a float8_e4m3fn cache with per-tensor k/v scales. Every
# variant (single-token, split-KV, tiled prefill with its per-sequence decode launch, each with
# and without the fused rotary) must write the cache the reference writes, bit for bit (the
# quantization of this step's keys included), and match its output over a batch mixing decodes,
# prefill chunks with context and padding.
FP8_MODES = {
    "single": {"num_splits": 1},
    "split3": {"num_splits": 3},
    "tiled": {"tiled": True},
    "auto": {},
}


@interpreted
@pytest.mark.parametrize(
    ("rotary", "dtype"),
    [(False, torch.float32), (True, torch.float16)],
    ids=["plain-fp32", "rotary-fp16"],
)  # the fused rotary in fp16, whose products round as the reference's (interpreter's time)
@pytest.mark.parametrize("mode", list(FP8_MODES))
def test_fp8_cache_matches_reference(dtype: torch.dtype, mode: str, rotary: bool):
    batch = ai.make_batch(
        [1, 6, 1, 3], [21, 6, 44, 13], num_q_heads=4, num_kv_heads=2,
        head_dim=32 if dtype == torch.float16 else 16, block_size=4, dtype=dtype,
        pad_tokens=2, pad_seqs=1, kv_cache_dtype=torch.float8_e4m3fn, kv_scales=(0.05, 0.02),
        seed=3,
    )  # fmt: skip
    atol = 1e-4 if dtype == torch.float32 else 2e-3
    rot_dim = batch.q.shape[-1] if rotary else None
    ai.check(batch, rot_dim=rot_dim, atol=atol, **FP8_MODES[mode])


@interpreted
def test_fp8_cache_write_saturates_and_scales():
    # Values past 448 * scale saturate at +-448 (vLLM's cache write), and the custom op (the
    # pass's emission) reads the scales from the tensors the model passes.
    batch = ai.make_batch([3], [3], block_size=4, kv_cache_dtype=torch.float8_e4m3fn,
                          kv_scales=(0.01, 0.01))  # fmt: skip
    batch.k[0] *= 100.0  # |k| up to ~300 over a 0.01 scale: far past e4m3's range
    cache_ref, cache_op = batch.kv_cache.clone(), batch.kv_cache.clone()
    expected = paged_attention_ref(*batch.args(cache_ref))
    got = torch.ops.ce_kernels.paged_attention(*batch.args(cache_op), KEY)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(cache_op, cache_ref)
    assert cache_op.float().abs().max() == 448.0


def test_fp8_cache_refuses_other_float8():
    batch = ai.make_batch([1], [5], block_size=4)
    cache = batch.kv_cache.to(torch.float8_e5m2)
    with pytest.raises(pa.PagedAttentionKernelError, match="float8_e4m3fn"):
        pa.paged_attention_triton(*batch.args(cache))


@pytest.mark.slow
def test_interpreter_cases_in_subprocess():
    if pa.INTERPRETED:
        pytest.skip("this session is interpreted already: the CPU cases ran in-process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [
        sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider",
        "-m", "not gpu", "-k", "not test_interpreter_cases_in_subprocess",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " skipped" not in proc.stdout.splitlines()[-1]


# ------------------------------------------------------------------------ GPU (bf16, real shapes)

LLAMA8B = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}


def _gpu_compare(
    batch: ai.PagedBatch,
    num_splits: int | None = None,
    tiled: bool | None = None,
    rot_dim: int | None = None,
) -> None:
    # The written cache must equal the reference's bit for bit (with rot_dim: the keys the
    # kernel rotated), the output be within 2e-2 and its cosine at least 0.999.
    stats = ai.check(batch, num_splits=num_splits, tiled=tiled, rot_dim=rot_dim, atol=2e-2)
    assert stats["cosine"] >= 0.999, f"cosine {stats['cosine']}"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("context", [512, 4096])
@pytest.mark.parametrize("batch_size", [1, 64, 256])
@pytest.mark.parametrize("num_splits", [None, 1, 8], ids=["auto", "single", "split8"])
def test_gpu_decode_bf16(batch_size: int, context: int, num_splits: int | None):
    batch = ai.make_batch(
        [1] * batch_size, [context] * batch_size, dtype=torch.bfloat16, device="cuda", **LLAMA8B
    )
    _gpu_compare(batch, num_splits)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_splits", [None, 4], ids=["auto", "split4"])
def test_gpu_mixed_bf16(num_splits: int | None):
    decode_lens = [int(x) for x in torch.randint(1, 3000, (62,), generator=torch.Generator())]
    batch = ai.make_batch(
        [512, 512] + [1] * 62,
        [512, 1024] + decode_lens,
        dtype=torch.bfloat16,
        device="cuda",
        **LLAMA8B,
    )
    _gpu_compare(batch, num_splits)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("context", [0, 1536])
def test_gpu_tiled_prefill_bf16(context: int):
    # Four 512-token chunks, with and without cached context, plus decodes and padding.
    batch = ai.make_batch(
        [512] * 4 + [1] * 4,
        [context + 512] * 4 + [700, 33, 2048, 5],
        pad_tokens=7,
        pad_seqs=2,
        dtype=torch.bfloat16,
        device="cuda",
        **LLAMA8B,
    )
    _gpu_compare(batch, tiled=True)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("shape", ["decode1", "decode64", "decode256", "mixed", "tiled"])
def test_gpu_rotary_bf16(shape: str):
    # bf16 on the H200: the kernel's rotation rounds as ce::rotary's bf16 ops do, so the keys
    # it writes equal the reference's bit for bit (_gpu_compare checks the cache).
    layouts = {
        "decode1": ([1], [700], None),
        "decode64": ([1] * 64, [513] * 64, None),
        "decode256": ([1] * 256, [100] * 256, None),
        "mixed": ([512, 300] + [1] * 30, [512, 1324] + [900] * 30, False),
        "tiled": ([512] * 3 + [1] * 4, [1024] * 3 + [700, 33, 2048, 5], True),
    }
    q_lens, seq_lens, tiled = layouts[shape]
    batch = ai.make_batch(
        q_lens, seq_lens, pad_tokens=3, dtype=torch.bfloat16, device="cuda", **LLAMA8B
    )
    _gpu_compare(batch, tiled=tiled, rot_dim=LLAMA8B["head_dim"])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_splits", [None, 6], ids=["auto", "split6"])
def test_gpu_tiled_splits_after_a_long_cached_prefix_bf16(num_splits: int | None):
    # Chunks of 176 and 32 tokens after 16,208 and 3,680 cached keys (bench prefix's 99% 16k
    # and a multi-turn message): few tiles, so the policy splits their cached keys.
    batch = ai.make_batch(
        [176, 32, 1, 1], [16384, 3712, 900, 33], pad_tokens=5, dtype=torch.bfloat16,
        device="cuda", **LLAMA8B,
    )  # fmt: skip
    _gpu_compare(batch, num_splits, tiled=True)


@pytest.mark.gpu
@requires_cuda
def test_gpu_tiled_matches_single_token_kernel_bf16():
    batch = ai.make_batch(
        [512, 300, 1], [2048, 300, 900], dtype=torch.bfloat16, device="cuda", **LLAMA8B
    )
    tiled = pa.paged_attention_triton(*batch.args(batch.kv_cache.clone()), tiled=True).float()
    single = pa.paged_attention_triton(*batch.args(batch.kv_cache.clone()), tiled=False).float()
    assert (tiled - single).abs().max().item() < 2e-2


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    "num_splits, tiled",
    [(None, None), (1, None), (None, True), (4, True)],
    ids=["auto", "single", "tiled", "tiled_split4"],
)
def test_gpu_cuda_graph_replay_matches_eager(num_splits: int | None, tiled: bool | None):
    # Captured on one batch, replayed on another of the same shapes: nothing value-dependent
    # may be baked into the graph (grid, split ranges, sequence lookup).
    shapes = dict(
        pad_tokens=4, pad_seqs=2, table_width=64, num_blocks=256, dtype=torch.bfloat16,
        device="cuda", **LLAMA8B,
    )  # fmt: skip
    first = ai.make_batch([1, 1, 5, 1], [100, 37, 5, 260], seed=1, **shapes)
    second = ai.make_batch([1, 1, 5, 1], [300, 2, 64, 17], seed=2, **shapes)

    def run(b: ai.PagedBatch) -> torch.Tensor:
        return pa.paged_attention_triton(*b.args(), num_splits=num_splits, tiled=tiled)

    expected = {}
    for name, b in (("first", first), ("second", second)):
        cache = b.kv_cache.clone()
        expected[name] = pa.paged_attention_triton(
            *b.args(cache), num_splits=num_splits, tiled=tiled
        )
    static = ai.make_batch([1, 1, 5, 1], [100, 37, 5, 260], seed=1, **shapes)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(static)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    for name, b in (("first", first), ("second", second)):
        for field in ("q", "k", "v", "kv_cache", "slot_mapping", "block_tables", "seq_lens"):
            getattr(static, field).copy_(getattr(b, field))
        static.query_start_loc.copy_(b.query_start_loc)
        if name == "first":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = run(static)
        graph.replay()
        torch.cuda.synchronize()
        real = int(b.query_start_loc[-1])
        assert torch.equal(out[:real], expected[name][:real]), name
        assert torch.equal(out[real:], torch.zeros_like(out[real:])), name


def test_compare_outputs_fails_on_a_cache_or_output_off_the_reference():
    # The oracle every attention kernel test goes through (check, and MLA's): a cache that
    # differs at all, or an output past atol (by dtype unless given), fails.
    expected = torch.ones(2, 4, dtype=torch.float16)
    cache = torch.zeros(3)
    stats = ai.compare_outputs(expected + 1e-3, expected, (cache, cache.clone()), "kv_cache")
    assert stats["max_abs_err"] == pytest.approx(1e-3, rel=0.1) and stats["cosine"] > 0.999
    with pytest.raises(AssertionError, match="max abs error"):
        ai.compare_outputs(expected + 1e-2, expected, (cache, cache.clone()), "kv_cache")
    ai.compare_outputs(expected + 1e-2, expected, (cache, cache.clone()), "kv_cache", atol=0.1)
    with pytest.raises(AssertionError, match="latent cache after the kernel differs"):
        ai.compare_outputs(expected, expected, (cache, cache + 1), "latent cache")
