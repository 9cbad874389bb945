"""On the H200 (skipped without CUDA): the FP8 KV cache through the CUDA path. The Triton
paged-attention kernels at Llama-3-8B's heads over a float8_e4m3fn cache (decode single-pass and
split-KV, the tiled prefill variant, the fused rotary, a CUDA-graph replay) write the cache the
reference writes, bit for bit, and match its output; a compiled engine with CUDA graphs and
kv_cache_dtype "fp8" decodes greedily as the reference ops over an FP8 cache do, with twice
the blocks in the same memory. The CPU cases (interpreted) are in
tests/kernels/test_paged_attention.py."""

from __future__ import annotations

import pytest
import torch

from compile_engine.benchmarks import attention_inputs as ai

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LLAMA8B = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}
FP8 = torch.float8_e4m3fn


def _batch(q_lens: list[int], seq_lens: list[int], seed: int = 0) -> ai.PagedBatch:
    return ai.make_batch(
        q_lens, seq_lens, dtype=torch.bfloat16, device="cuda", kv_cache_dtype=FP8,
        kv_scales=(0.03, 0.02), seed=seed, **LLAMA8B,
    )  # fmt: skip


def _check(batch: ai.PagedBatch, **launch) -> None:
    # The cache equal bit for bit (the kernel's e4m3 rounding is the reference's), the output
    # within bf16's tolerance of the reference's, which dequantizes to bf16 before its SDPA.
    stats = ai.check(batch, atol=3e-2, **launch)
    assert stats["cosine"] >= 0.999, stats


@pytest.mark.parametrize("context", [512, 4096])
@pytest.mark.parametrize("batch_size", [1, 64])
@pytest.mark.parametrize("num_splits", [None, 1], ids=["auto", "single"])
def test_decode_over_an_fp8_cache(batch_size: int, context: int, num_splits: int | None):
    batch = _batch([1] * batch_size, [context - 7 * i for i in range(batch_size)])
    _check(batch, num_splits=num_splits)


@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "single"])
def test_mixed_batch_over_an_fp8_cache(tiled: bool, rotary: bool):
    # Prefill chunks with context and decodes in one launch (the tiled kernel and its
    # per-sequence decode launch, or the single-token kernel for every token).
    batch = _batch([300, 1, 77, 1, 512], [812, 640, 77, 3000, 1024], seed=3)
    _check(batch, tiled=tiled, rot_dim=128 if rotary else None)


def test_cuda_graph_replay_over_an_fp8_cache():
    from compile_engine.kernels_generated import paged_attention as pa

    batch = _batch([1] * 32, [1500] * 32, seed=5)
    cache = batch.kv_cache.clone()
    eager = pa.paged_attention_triton(*batch.args(cache.clone()))
    pa.paged_attention_triton(*batch.args(cache.clone()))  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pa.paged_attention_triton(*batch.args(cache))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_engine_with_an_fp8_cache_and_cuda_graphs(tmp_path):
    from fp8_models import make_tiny_llama

    from compile_engine import LLM, SamplingParams
    from compile_engine.runtime.model_runner import kv_bytes_per_block

    from oracle import assert_greedy_near_ties, mixed_prompts

    model = make_tiny_llama(tmp_path / "llama", dtype=torch.bfloat16)
    settings = dict(target="h100", dtype="bfloat16", max_num_seqs=16, max_model_len=256)
    prompts = mixed_prompts(96, seed=1)
    plain = LLM(str(model), **settings)
    block_bytes = kv_bytes_per_block(plain.engine.loaded, 16)
    del plain
    # The oracle: the reference ops over an FP8 cache (quantize on write, dequantize on read),
    # eager on the same GPU. Against the bf16 cache no bar is meaningful: with these random
    # weights the cache's rounding alone flips ~20% of greedy tokens (measured on the CPU's
    # reference, 133 of 168 equal), at near-ties of a few thousandths of a nat.
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=4)
    reference = LLM(str(model), kv_cache_dtype="fp8", enforce_eager=True, **settings)
    want = [o.outputs[0] for o in reference.generate(prompts, params)]
    del reference
    torch.cuda.empty_cache()
    llm = LLM(str(model), kv_cache_dtype="fp8", **settings)
    assert llm.engine.runner.graphs is not None, "no CUDA graphs were captured"
    assert all(c.dtype == FP8 for c in llm.engine.runner.kv_caches)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert_greedy_near_ties(got, want, max_gap=0.02, min_equal=0.75)
    # A block takes half the bytes (tests/runtime/test_fp8_kv_cache.py: twice the blocks).
    assert 2 * kv_bytes_per_block(llm.engine.loaded, 16) == block_bytes
