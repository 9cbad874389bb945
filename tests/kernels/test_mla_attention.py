"""The Triton MLA latent-attention kernel against `models.mla.mla_latent_attention_ref`.

CPU cases run under the Triton interpreter in a child pytest whose environment sets
TRITON_INTERPRET=1 from its start (see tests/kernels/test_paged_attention.py for why the
variable cannot be set in this process). GPU cases run bf16 at DeepSeek-V2-Lite's shapes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from compile_engine.benchmarks import attention_inputs as ai
from compile_engine.kernels_generated import mla_attention as mk
from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.device import CPU_SM_COUNT
from compile_engine.kernels_generated.paged_attention import launch as paged_launch
from compile_engine.kernels_generated.tuning import KernelConfig, LatentConfig, MlaTuning
from compile_engine.models.mla import (
    mla_attention_absorbed,
    mla_attention_ref,
    mla_latent_attention_ref,
)

from pass_kit import run_interpreted

interpreted = pytest.mark.interpreted_child("TRITON_INTERPRET")
KEY = tuning.default().key  # the op's last argument: the kernel config the pass gives it
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or mk.INTERPRETED,
    reason="needs CUDA (and compiled, not interpreted, Triton)",
)

# (q_lens, seq_lens, extra make_batch arguments). seq_len counts the step's new tokens.
CASES = {
    "decode": ([1, 1, 1, 1], [9, 17, 1, 40], {}),
    "chunked_prefill": ([4, 3], [13, 30], {}),
    "mixed": ([1, 6, 1, 3], [21, 6, 44, 13], {}),
    # Two head blocks (20 heads, 16 a program), rank and rope not powers of two (masked).
    "odd_shapes": ([1, 3], [19, 7], {"num_heads": 20, "kv_lora_rank": 24, "rope_dim": 8}),
    # Padded as the runner pads to a captured size: spare table columns and blocks too.
    "padded": ([1, 3, 1], [25, 3, 41], {"pad_tokens": 3, "pad_seqs": 2, "spare_blocks": 3}),
    "empty_seq_between": ([2, 0, 1], [2, 5, 38], {}),
}


def _batch(name: str, block_size: int, dtype: torch.dtype, seed: int = 0) -> ai.LatentBatch:
    q_lens, seq_lens, extra = CASES[name]
    extra = dict(extra)
    if spare := extra.pop("spare_blocks", 0):
        blocks = [-(-n // block_size) for n in seq_lens]
        extra.update(table_width=max(blocks) + spare, num_blocks=1 + sum(blocks) + spare)
    return ai.make_latent_batch(
        q_lens, seq_lens, block_size=block_size, dtype=dtype, seed=seed, qk_head_dim=24, **extra
    )


# --------------------------------------------------------------------------- CPU (interpreter)


@interpreted
@pytest.mark.parametrize("num_splits", [1, 3], ids=["single", "split3"])
@pytest.mark.parametrize("block_size", [1, 5])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_fp32(case: str, block_size: int, num_splits: int):
    # check() also compares the latent cache written by the kernel with the reference's.
    ai.check_latent(_batch(case, block_size, torch.float32, seed=block_size), num_splits=num_splits)


@interpreted
@pytest.mark.parametrize("num_splits", [1, 2])
def test_matches_reference_fp16(num_splits: int):
    ai.check_latent(_batch("mixed", 4, torch.float16), num_splits=num_splits, atol=2e-3)


@interpreted
def test_padding_tokens_are_zero_and_real_tokens_unaffected():
    batch = _batch("padded", 3, torch.float32)
    out = mk.mla_latent_attention_triton(*batch.args(batch.latent_cache.clone()), num_splits=2)
    real = int(batch.query_start_loc[-1])
    assert torch.equal(out[real:], torch.zeros_like(out[real:]))
    assert out[:real].abs().sum() > 0


@interpreted
def test_absorbed_with_kernel_equals_naive_reference():
    """The whole absorbed form with this kernel as its core equals the naive up-projected
    attention (the pass's rewrite, end to end, on one layer's inputs)."""
    batch = _batch("mixed", 4, torch.float32)
    heads, nope, rope, rank, v_dim = 4, 16, 16, 32, 24
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(batch.q_latent.shape[0], heads, nope + rope, generator=gen)
    w_kv_b = torch.randn(heads * (nope + v_dim), rank, generator=gen) * 0.3
    meta = (batch.slot_mapping, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    cache_naive, cache_kernel = batch.latent_cache.clone(), batch.latent_cache.clone()
    want = mla_attention_ref(q, batch.kv_latent, cache_naive, *meta, w_kv_b, 0.2)
    got = mla_attention_absorbed(
        q, batch.kv_latent, cache_kernel, *meta, w_kv_b, 0.2,
        latent_attention=mk.mla_latent_attention_triton,
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(cache_kernel, cache_naive)


@interpreted
def test_custom_op_traces_as_one_node_and_mutates_cache():
    batch = _batch("decode", 4, torch.float32)

    def step(*args):
        return torch.ops.ce_kernels.mla_latent_attention(*args, KEY) * 2

    cache_ref, cache_op = batch.latent_cache.clone(), batch.latent_cache.clone()
    expected = mla_latent_attention_ref(*batch.args(cache_ref)) * 2
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*batch.args(cache_op)), expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(cache_op, cache_ref)


# --------------------------------------------------------------------------- anywhere


def test_choose_num_splits_reads_shapes_only():
    cpu = torch.device("cpu")
    default = tuning.default()
    assert mk.choose_num_splits(default, CPU_SM_COUNT, 1, 32768, cpu) == 1  # enough programs
    assert mk.choose_num_splits(default, 1, 1, 32768, cpu) > 1  # one long decode: split
    assert mk.choose_num_splits(default, 1, 1, 16, cpu) == 1  # short context: nothing to split
    assert mk.choose_num_splits(default, 1, 1, 10**7, cpu) <= default.mla.max_splits


def test_split_policy_is_paged_attentions_with_the_configs_numbers():
    # The numbers MLA had before the policy was shared: 256 keys a split at least, 64 splits
    # at most; the count is paged attention's split_count over T x head-block programs.
    cpu = torch.device("cpu")
    default = tuning.default()
    assert (default.mla.min_split_keys, default.mla.max_splits) == (256, 64)
    for tokens, head_blocks, context in [(1, 1, 700), (1, 2, 32768), (3, 1, 4096), (8, 1, 99)]:
        assert mk.choose_num_splits(default, tokens, head_blocks, context, cpu) == (
            paged_launch.split_count(tokens * head_blocks, context, 256, 64, cpu)
        )
    assert mk.choose_num_splits(default, 1, 1, 700, cpu) == 3  # 700 keys, 256 a split
    fewer = KernelConfig(mla=dataclasses.replace(MlaTuning(), min_split_keys=64, max_splits=4))
    assert mk.choose_num_splits(fewer, 1, 1, 700, cpu) == 4  # the cap


@interpreted
def test_tiles_from_the_kernel_config():
    # Other tiles (BLOCK_N 32, 2 warps, a 2-column reduce) and a custom op given that config's
    # key: still the reference's output, single pass and split.
    tiles = LatentConfig(32, 16, num_warps=2, num_stages=1, reduce_warps=1)
    config = KernelConfig(mla=dataclasses.replace(MlaTuning(), latent_cpu=tiles, reduce_block_r=2))
    batch = _batch("odd_shapes", 3, torch.float32)
    for num_splits in (1, 3):
        ai.check_latent(batch, num_splits=num_splits, kernel_config=config)
    cache_ref, cache_op = batch.latent_cache.clone(), batch.latent_cache.clone()
    expected = mla_latent_attention_ref(*batch.args(cache_ref))
    got = torch.ops.ce_kernels.mla_latent_attention(*batch.args(cache_op), config.key)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(cache_op, cache_ref)


def test_rejects_mismatched_cache():
    batch = ai.make_latent_batch([1], [3])
    with pytest.raises(mk.MLAKernelError, match="shape mismatch"):
        mk.mla_latent_attention_triton(
            batch.q_latent, batch.kv_latent, torch.zeros(2, 4, 40), batch.slot_mapping,
            batch.block_tables, batch.seq_lens, batch.query_start_loc, 32, 1.0,
        )  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(mk.INTERPRETED, reason="this is the parent of the interpreted run")
def test_interpreter_cases_in_subprocess():
    child = run_interpreted(__file__, "TRITON_INTERPRET", "-m", "not gpu", "-k", "not subprocess")
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-3000:]
    last = child.stdout.strip().splitlines()[-1]
    assert " passed" in last and "skipped" not in last, last


# ------------------------------------------------------------ GPU (bf16, DeepSeek-V2-Lite shapes)

V2_LITE = {"num_heads": 16, "kv_lora_rank": 512, "rope_dim": 64, "block_size": 16}
V2_LITE_QK = 128 + 64  # the softmax scale is that of a qk head (nope + rope)


def _gpu_compare(batch: ai.LatentBatch, num_splits: int | None = None) -> None:
    # The written cache equal to the reference's, the output within 2e-2, cosine >= 0.999.
    stats = ai.check_latent(batch, num_splits=num_splits, atol=2e-2)
    assert stats["cosine"] >= 0.999, f"cosine {stats['cosine']}"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("context", [512, 4096])
@pytest.mark.parametrize("batch_size", [1, 64])
@pytest.mark.parametrize("num_splits", [None, 1, 8], ids=["auto", "single", "split8"])
def test_gpu_decode_bf16(batch_size: int, context: int, num_splits: int | None):
    batch = ai.make_latent_batch(
        [1] * batch_size, [context] * batch_size, dtype=torch.bfloat16, device="cuda",
        qk_head_dim=V2_LITE_QK, **V2_LITE,
    )  # fmt: skip
    _gpu_compare(batch, num_splits)


@pytest.mark.gpu
@requires_cuda
def test_gpu_mixed_bf16():
    decode_lens = [int(x) for x in torch.randint(1, 3000, (30,), generator=torch.Generator())]
    batch = ai.make_latent_batch(
        [256, 100] + [1] * 30, [256, 900] + decode_lens, dtype=torch.bfloat16, device="cuda",
        qk_head_dim=V2_LITE_QK, **V2_LITE,
    )  # fmt: skip
    _gpu_compare(batch)


@pytest.mark.gpu
@requires_cuda
def test_gpu_cuda_graph_replay_matches_eager():
    # Captured on one batch, replayed on another of the same shapes: nothing value-dependent
    # may be baked into the graph (grid, split ranges, sequence lookup).
    shapes = dict(
        pad_tokens=4, pad_seqs=2, table_width=64, num_blocks=256, dtype=torch.bfloat16,
        device="cuda", qk_head_dim=V2_LITE_QK, **V2_LITE,
    )  # fmt: skip
    first = ai.make_latent_batch([1, 1, 5, 1], [100, 37, 5, 260], seed=1, **shapes)
    second = ai.make_latent_batch([1, 1, 5, 1], [300, 2, 64, 17], seed=2, **shapes)
    static = [t.clone() for t in first.args() if isinstance(t, torch.Tensor)]
    rank, scale = first.kv_lora_rank, first.scale

    def run() -> torch.Tensor:
        return mk.mla_latent_attention_triton(*static[:7], rank, scale)

    run()  # warm-up: compile outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    fresh = [t for t in second.args() if isinstance(t, torch.Tensor)]
    for dst, src in zip(static, fresh, strict=True):
        dst.copy_(src)
    reference_cache = second.latent_cache.clone()
    expected = mla_latent_attention_ref(*second.args(reference_cache)).float()
    graph.replay()
    torch.cuda.synchronize()
    cos = torch.nn.functional.cosine_similarity(
        out.float().flatten(), expected.flatten(), dim=0
    ).item()
    assert cos >= 0.999, f"cosine {cos}"
    assert torch.equal(static[2], reference_cache)
