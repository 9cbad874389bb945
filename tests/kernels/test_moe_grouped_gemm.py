"""The fused MoE Triton kernels (kernels_generated/moe_grouped_gemm.py) against the reference
chain of models/moe.py.

CPU cases run under the Triton interpreter in a child pytest whose environment sets
TRITON_INTERPRET=1 from its start (see tests/kernels/test_paged_attention.py for why it may not
be set in this process); GPU cases run bf16 at real MoE shapes. The kernel is compared with
the reference through the shared harness (benchmarks/kernel_harness.py, the moe_grouped_gemm
spec's tolerance per dtype)."""

from __future__ import annotations

import pytest
import torch

from compile_engine.benchmarks.kernel_harness import check
from compile_engine.benchmarks.kernel_specs import moe_inputs, spec_of
from compile_engine.kernels_generated import moe_grouped_gemm as mk
from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.configs import CONFIG_DIR, ConfigTable
from compile_engine.kernels_generated.tuning import KernelConfig
from compile_engine.models.moe import align_capacity, moe_align_ref

from pass_kit import run_interpreted

interpreted = pytest.mark.interpreted_child("TRITON_INTERPRET")
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or mk.INTERPRETED,
    reason="needs CUDA (and compiled, not interpreted, Triton)",
)

# (T, E, H, I, K): widths that are not multiples of the tiles, one token, an expert count
# that is not a power of two, every expert busy.
SHAPES = [(1, 8, 64, 32, 2), (5, 6, 48, 40, 3), (13, 8, 64, 32, 2), (6, 4, 32, 16, 4)]
KEY = tuning.default().key  # the op's last argument: the kernel config the pass gives it
MOE = spec_of("moe_grouped_gemm")  # shapes (T, E, H, I, K)


# --------------------------------------------------------------------------- CPU (interpreter)


@interpreted
@pytest.mark.parametrize("shape", SHAPES, ids=[f"T{s[0]}-E{s[1]}-H{s[2]}-I{s[3]}" for s in SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fused_experts_match_reference(shape, dtype):
    # The op with the shipped table's tiles; absolute 1e-4 in float32, 5e-3 in float16.
    check(MOE, device="cpu", shapes=(shape,), dtype=dtype)


@interpreted
@pytest.mark.parametrize("num_tokens, top_k, num_experts", [(1, 2, 8), (9, 3, 6), (30, 4, 70)])
def test_align_kernel_matches_reference(num_tokens, top_k, num_experts):
    # 30 x 4 slots cross the 64-slot chunk; 70 experts pad to 128 lanes.
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen, dtype=torch.int32)
    got_sorted, got_blocks = mk.moe_align_triton(ids, num_experts, 16)
    want_sorted, want_blocks = moe_align_ref(ids, num_experts, 16)
    assert torch.equal(got_blocks, want_blocks)
    # Within a block the order of the slots is free; the sets must agree.
    assert torch.equal(got_sorted.view(-1, 16).sort(1).values,
                       want_sorted.view(-1, 16).sort(1).values)  # fmt: skip


@interpreted
def test_explicit_tiles_and_custom_op_under_compile():
    tiles = {"BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 1, "num_stages": 1}
    check(MOE, device="cpu", shapes=((7, 8, 64, 32, 2),),
          config={"BLOCK_M": 16, "gemm1": tiles, "gemm2": tiles})  # fmt: skip
    inputs = moe_inputs(7, 8, 64, 32, 2, seed=3)

    def layer(x, w13, w2, weights, ids):
        return torch.ops.ce_kernels.moe_fused_experts(x, w13, w2, weights, ids, KEY) * 2

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*inputs), mk.fused_experts_ref(*inputs) * 2,
                               atol=1e-4, rtol=1e-4)  # fmt: skip


# --------------------------------------------------------------------------- anywhere


def test_interpreter_cases_in_subprocess():
    if mk.INTERPRETED:
        pytest.skip("this session is interpreted already: the CPU cases ran in-process")
    proc = run_interpreted(__file__, "TRITON_INTERPRET", "-m", "not gpu", "-k",
                           "not in_subprocess and not refused")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " skipped" not in proc.stdout.splitlines()[-1]


def test_large_slot_counts_align_with_the_sync_free_reference():
    ids = torch.randint(0, 64, (1200, 4), dtype=torch.int32)  # 4800 slots > one program's share
    sorted_ids, block_expert = mk.moe_align_triton(ids, 64, 16)
    assert sorted_ids.numel() == align_capacity(4800, 64, 16)
    assert torch.equal(sorted_ids, moe_align_ref(ids, 64, 16)[0])
    assert block_expert.numel() == sorted_ids.numel() // 16


def test_config_table_picks_nearest_entry():
    table = tuning.default().table("moe_grouped_gemm")
    assert {"BLOCK_M", "gemm1", "gemm2"} <= set(table.default)
    for section in table.targets.values():
        assert all(e.config["BLOCK_M"] >= 16 for e in section.entries)  # tl.dot's minimum
    # A CPU shape gets the interpreter's small tiles, not the GPU default.
    assert mk.pick_config(tuning.default(), 8, 64, 32, 10, torch.device("cpu")) == (
        table.targets["cpu"].entries[0].config
    )


def test_tiles_come_from_the_kernel_configs_table(tmp_path):
    # A table named in KernelConfig.tables is the one fused_experts picks its tiles from.
    table = ConfigTable.load(CONFIG_DIR / "moe_grouped_gemm.json")
    tiles = {"BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 1, "num_warps": 1, "num_stages": 1}
    table.targets["cpu"].entries[0].config = {"BLOCK_M": 32, "gemm1": tiles, "gemm2": tiles}
    config = KernelConfig(tables={"moe_grouped_gemm": str(table.save(tmp_path / "t.json"))})
    picked = mk.pick_config(config, 8, 64, 32, 10, torch.device("cpu"))
    assert picked == {"BLOCK_M": 32, "gemm1": tiles, "gemm2": tiles}


def test_benchmark_report_and_active_expert_count():
    from compile_engine.benchmarks import moe as bench_moe

    assert bench_moe.expected_busy_experts(128, 8, 1) == pytest.approx(8)
    assert 120 < bench_moe.expected_busy_experts(128, 8, 64) < 128
    row = dict(experts=128, hidden=2048, inter=768, top_k=8, tokens=64, fused_ms=0.3,
               loop_ms=38.5, speedup=128.3, fused_weight_GB_s=3877.0,
               fused_TFLOP_s=15.6)  # fmt: skip
    decode = {"model": "m", "input_len": 32, "output_len": 128,
              "batches": {"1": {"decode_tok_s": 697.2, "ms_per_step": 1.43,
                                "active_roofline_pct": 25.0}}}  # fmt: skip
    lines = bench_moe.render_details({"kernel": [row], "decode": decode})
    assert any("| 64 | 0.300 | 38.500 | 128.3x |" in line for line in lines)
    assert any(line.startswith("| 1 | 697.2 | 1.43 | 25% |") for line in lines)


def test_fake_gives_output_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 64)
        out = torch.ops.ce_kernels.moe_fused_experts(
            x, torch.empty(8, 64, 64), torch.empty(8, 64, 32), torch.empty(5, 2),
            torch.empty(5, 2, dtype=torch.int32), KEY,
        )  # fmt: skip
    assert out.shape == (5, 64)


def test_cpu_without_interpreter_is_refused():
    if mk.INTERPRETED:
        pytest.skip("interpreted session")
    inputs = moe_inputs(2, 8, 64, 32, 2)
    with pytest.raises(mk.MoEKernelError, match="TRITON_INTERPRET"):
        mk.fused_experts(*inputs)


# ------------------------------------------------------------------------ GPU (bf16, real shapes)

# Qwen3-30B-A3B (128 experts, top-8, H 2048, I 768) and a 64-expert variant; Mixtral's 8 x top-2
# at a reduced width.
GPU_SHAPES = [(128, 2048, 768, 8), (64, 2048, 768, 8), (8, 1024, 3584, 2)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    "shape", GPU_SHAPES, ids=[f"E{s[0]}-H{s[1]}-I{s[2]}-K{s[3]}" for s in GPU_SHAPES]
)
@pytest.mark.parametrize("num_tokens", [1, 64, 256, 2048])
def test_gpu_bf16_matches_reference(shape, num_tokens):
    # The reference rounds h and silu(gate) * up to bf16 where the kernel keeps float32: up to
    # ~2 bf16 ulps of the output's largest value (measured 1.3% at T 2048 on the H200), and a
    # cosine of at least 0.9999 (kernel_specs.MOE_TOLERANCE).
    check(MOE, shapes=((num_tokens, *shape),), dtype=torch.bfloat16)


@pytest.mark.gpu
@requires_cuda
def test_gpu_cuda_graph_replay_follows_new_routing():
    # Captured with one routing, replayed with another: nothing routing-dependent may be baked
    # into the graph (grid, block count, alignment).
    first = moe_inputs(64, 128, 2048, 768, 8, dtype=torch.bfloat16, device="cuda", seed=1)
    second = moe_inputs(64, 128, 2048, 768, 8, dtype=torch.bfloat16, device="cuda", seed=2)
    static = [t.clone() for t in first]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mk.fused_experts(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mk.fused_experts(*static)
    for inputs in (second, first):
        for dst, src in zip(static, inputs, strict=True):
            dst.copy_(src)
        graph.replay()
        torch.testing.assert_close(out, mk.fused_experts(*inputs), atol=1e-2, rtol=0)
