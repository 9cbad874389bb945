"""Offline sm_90 compiles of Triton kernels on the CPU (Triton's own ptxas, no GPU): the
interpreter type-checks nothing, so what only the GPU's compiler refuses shows here."""

from __future__ import annotations

import pytest
import triton


def _compile_sm90(kernel, pointers: dict, constants: dict, aligned=(), **options):
    """`kernel` compiled for sm_90 by Triton's own ptxas: pointer and constexpr arguments as
    given, every other argument a 32-bit integer; `aligned` integers (and the pointers, then)
    divisible by 16, as Triton specializes them at a launch."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {n: "constexpr" if n in constants else pointers.get(n, "i32") for n in names}
    attrs = {}
    if aligned:
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in [*pointers, *aligned]}
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(n),): v for n, v in constants.items()},
        attrs=attrs,
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert "cubin" in compiled.asm
    return compiled


@pytest.mark.parametrize("num_splits", [1, 4])
def test_tiled_kernel_compiles_for_sm90(num_splits: int):
    # The interpreter type-checks nothing: an offline sm_90 compile (Triton's own ptxas, no GPU)
    # catches what only the GPU's compiler refuses, e.g. a split-only branch compiled for one
    # pass, where the workspace pointers are the bf16 output's.
    from compile_engine.kernels_generated.paged_attention.kernels import (
        _paged_attention_tiled_kernel as kernel,
    )

    ws = "*fp32" if num_splits > 1 else "*bf16"  # one pass: the launch passes `out` for them
    pointers = dict.fromkeys(["q_ptr", "k_new_ptr", "v_new_ptr", "k_cache_ptr", "v_cache_ptr",
                              "out_ptr"], "*bf16")  # fmt: skip
    pointers.update(m_ws_ptr=ws, l_ws_ptr=ws, acc_ws_ptr=ws, slot_mapping_ptr="*i64")
    pointers.update(counters_ptr="*i32" if num_splits > 1 else "*bf16", k_scale_ptr="*fp32")
    pointers.update(v_scale_ptr="*fp32", block_tables_ptr="*i32", seq_lens_ptr="*i32")
    pointers.update(query_start_loc_ptr="*i32", qk_scale="fp32")
    constants = dict(GROUP=4, GROUP_P2=4, BLOCK_M=16, HEAD_DIM=128, KV_BLOCK_SIZE=16, BLOCK_N=32,
                     COMPUTE_F32=False, DOT_PRECISION="ieee", FP8_KV=False, NUM_SPLITS=num_splits,
                     MIN_SPLIT_KEYS=256)  # fmt: skip
    _compile_sm90(kernel, pointers, constants, num_warps=4)


@pytest.mark.parametrize(
    "num_splits,write_only", [(1, True), (4, False), (1, False)], ids=["write", "split", "one"]
)
def test_single_token_kernel_compiles_for_sm90(num_splits: int, write_only: bool):
    """The decode kernel with the 1-16-token tier's unsplit bound (a short sequence takes one
    split in a wide table), PDL and rotary as the engine launches it, and its write-only form
    (the launch that writes a step's K/V before the rows of a verification step attend)."""
    from compile_engine.kernels_generated.paged_attention.kernels import (
        _paged_attention_kernel as kernel,
    )

    ws = "*fp32" if num_splits > 1 else "*bf16"
    pointers = dict.fromkeys(["q_ptr", "k_new_ptr", "v_new_ptr", "k_cache_ptr", "v_cache_ptr",
                              "out_ptr"], "*bf16")  # fmt: skip
    pointers.update(m_ws_ptr=ws, l_ws_ptr=ws, acc_ws_ptr=ws, slot_mapping_ptr="*i64")
    pointers.update(counters_ptr="*i32" if num_splits > 1 else "*bf16", k_scale_ptr="*fp32")
    pointers.update(v_scale_ptr="*fp32", block_tables_ptr="*i32", seq_lens_ptr="*i32")
    pointers.update(query_start_loc_ptr="*i32", qk_scale="fp32", positions_ptr="*i64")
    pointers.update(cos_sin_ptr="*fp32")
    constants = dict(GROUP=4, BLOCK_G=16, HEAD_DIM=128, KV_BLOCK_SIZE=16, BLOCK_N=64,
                     NUM_SPLITS=num_splits, MIN_SPLIT_KEYS=64, UNSPLIT_KEYS=160, COMBINE_G=4,
                     COMBINE_S=min(8, num_splits), COMPUTE_F32=False, DOT_PRECISION="ieee",
                     BY_SEQ=False, ROT_DIM=128, ROTARY=True, FP8_KV=False, PDL=True,
                     WRITE_ONLY=write_only)  # fmt: skip
    _compile_sm90(kernel, pointers, constants, num_warps=4, num_stages=2)


@pytest.mark.parametrize(
    "bits,zp,dequant,swap,x",
    [
        (4, False, False, False, "bf16"),
        (8, False, False, True, "bf16"),
        (4, False, True, False, "bf16"),
        (4, False, True, True, "bf16"),
        (4, True, True, True, "bf16"),
        (4, False, True, False, "fp16"),
    ],
)
def test_int_linear_kernel_compiles_for_sm90(bits, zp, dequant, swap, x):
    """The integer weight-only GEMM's tensor-core forms, with the split-K branch (split_k is a
    runtime argument: both branches compile)."""
    from compile_engine.kernels_generated.int_linear import _int_linear_kernel as kernel

    pointers = dict(x_ptr=f"*{x}", w_ptr="*u8", s_ptr="*fp32", out_ptr=f"*{x}", ws_ptr="*fp32",
                    counter_ptr="*i32")  # fmt: skip
    constants = dict(BITS=bits, ZP=zp, ZERO=0 if zp or bits == 8 else 8, GROUP=128, BLOCK_M=16,
                     BLOCK_N=64, BLOCK_K=128, BITS_DEQUANT=dequant, SWAP=swap)  # fmt: skip
    _compile_sm90(kernel, pointers, constants, num_warps=4)


@pytest.mark.parametrize("bits,zp,block_k", [(4, False, 64), (4, True, 64), (8, False, 64),
                                             (4, False, 128)])  # fmt: skip
def test_int_fma_kernel_compiles_for_sm90(bits, zp, block_k):
    """The one-row form: 16-byte loads of the words (the row stride is an argument, so Triton
    knows its alignment), and in the K loop no layout change of a [BN, CW] tile (a
    shared-memory round trip of every code)."""
    from compile_engine.kernels_generated.int_linear import _int_fma_kernel as kernel

    pointers = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*fp32", out_ptr="*bf16", ws_ptr="*fp32",
                    counter_ptr="*i32")  # fmt: skip
    constants = dict(BITS=bits, ZP=zp, ZERO=8, GROUP=128, BLOCK_N=256, BLOCK_K=block_k)
    compiled = _compile_sm90(kernel, pointers, constants, num_warps=4, num_stages=1,
                             aligned=("K", "stride_xm", "stride_om", "stride_wn"))  # fmt: skip
    loop = _loop_of(compiled.asm["ttgir"])
    cw = block_k * bits // 32
    converts = [ln for ln in loop.splitlines() if "convert_layout" in ln]
    assert not [ln for ln in converts if f": tensor<256x{cw}x" in ln], converts
    assert "LDG.E.128" in _sass(compiled)


def _sass(compiled) -> str:
    import subprocess
    import tempfile
    from pathlib import Path

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip


def _loop_of(ttgir: str) -> str:
    """The body of the kernel's K loop (its first scf.for) in Triton's GPU IR."""
    start = ttgir.index("scf.for")
    return ttgir[start : ttgir.index("scf.yield", start)]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_moe_gemm_stages_fit_shared_memory_for_sm90(dtype: str):
    """The MoE table's largest gate+up tiles (tuned in bf16) at the stages `fit_stages` leaves
    compile within Hopper's shared memory in float32 too (3 stages asked 272 KiB there)."""
    from compile_engine.kernels_generated.moe_grouped_gemm import (
        SHARED_MEMORY_BYTES,
        fit_stages,
    )
    from compile_engine.kernels_generated.moe_grouped_gemm import _moe_gemm_kernel as kernel

    tiles = {"BLOCK_N": 128, "BLOCK_K": 128, "num_stages": 3}
    stages = fit_stages(tiles, 16, 4 if dtype == "fp32" else 2, silu=True)
    assert stages == (2 if dtype == "fp32" else 3)
    pointers = dict(a_ptr=f"*{dtype}", w_ptr=f"*{dtype}", out_ptr=f"*{dtype}",
                    weights_ptr="*fp32", sorted_ptr="*i32", block_expert_ptr="*i32")  # fmt: skip
    constants = dict(ROWS_PER_TOKEN=8, SILU=True, MUL_WEIGHTS=False, COMPUTE_F32=False,
                     DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", BLOCK_M=16,
                     BLOCK_N=128, BLOCK_K=128, GROUP_M=8)  # fmt: skip
    compiled = _compile_sm90(kernel, pointers, constants, num_warps=8, num_stages=stages)
    assert compiled.metadata.shared <= SHARED_MEMORY_BYTES
