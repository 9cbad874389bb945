"""The Triton skinny GEMM against F.linear (`linear_ref`), its per-call choice from the tuned
table (the kernel config's: a test's table is a file named in `KernelConfig.tables`), its PDL
settings, and the op's fake.

The CPU kernel cases (marked interpreted_child) run in one TRITON_INTERPRET=1 child that
`test_interpreted_cases_in_one_child` starts, together with the skinny_gemm pass's numerics
case (tests/passes/test_skinny_gemm_pass.py); GPU cases: the tuned configs at the Llama-3-8B
shapes in bf16, and CUDA-graph replay of a split-K launch (its counters must reset)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from compile_engine.benchmarks.kernel_harness import check
from compile_engine.benchmarks.kernel_specs import spec_of
from compile_engine.kernels_generated import skinny_gemm as k
from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.configs import ConfigEntry, ConfigTable, TargetConfigs
from compile_engine.kernels_generated.tuning import KernelConfig

interpreted = pytest.mark.interpreted_child("TRITON_INTERPRET")
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or k.INTERPRETED,
    reason="needs CUDA (and compiled, not interpreted, Triton)",
)
HERE = Path(__file__).resolve().parent


def _inputs(rows: int, n_size: int, k_size: int, dtype: torch.dtype, device: str = "cpu"):
    gen = torch.Generator(device=device).manual_seed(rows * 1000 + n_size + k_size)
    x = torch.randn(rows, k_size, generator=gen, device=device).to(dtype)
    w = (torch.randn(n_size, k_size, generator=gen, device=device) / k_size**0.5).to(dtype)
    return x, w


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def table_of(
    entries: dict[tuple[int, int, int], dict], fused: dict[tuple[int, int, int], dict] | None = None
) -> ConfigTable:
    """An in-memory config table: {(N, K, M): config} for target h100, with `fused` records
    ({"plain" | "gated": launch config}) where given."""
    made = [
        ConfigEntry(
            {"N": n, "K": kk, "M": m},
            c,
            {"fused": {kind: {"config": f} for kind, f in fused[n, kk, m].items()}}
            if fused and (n, kk, m) in fused
            else {},
        )
        for (n, kk, m), c in entries.items()
    ]
    return ConfigTable("skinny_gemm", ("N", "K", "M"), {"kernel": "cublas"}, {
        "h100": TargetConfigs(True, made)
    })  # fmt: skip


@pytest.fixture
def use_table(tmp_path):
    """A kernel config whose skinny_gemm table is one the test writes (a file of its own, so
    its key and its lookups are its own)."""

    def install(table: ConfigTable) -> KernelConfig:
        path = table.save(tmp_path / f"skinny_gemm_{len(list(tmp_path.iterdir()))}.json")
        return KernelConfig(tables={"skinny_gemm": str(path)})

    return install


# --------------------------------------------------------------------------- interpreted kernel

# (mode, block_m, block_n, block_k, split): every inner product, a split that divides K, one that
# does not (masked K tail), a block_n that leaves a partial N tile.
CONFIGS = {
    "swap": ("swap", 16, 16, 16, 1),
    "swap_split3": ("swap", 16, 32, 16, 3),
    "dot_split2": ("dot", 16, 16, 32, 2),
    "fma": ("fma", 4, 16, 32, 1),
    "fma_split2": ("fma", 2, 16, 16, 2),
}


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,n_size,k_size", [(1, 40, 80), (3, 48, 72), (17, 24, 64)])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_interpreted_matches_reference(name, rows, n_size, k_size, dtype):
    mode, bm, bn, bk, split = CONFIGS[name]
    x, w = _inputs(rows, n_size, k_size, dtype)
    got = k.skinny_gemm(x, w, mode=mode, block_m=bm, block_n=bn, block_k=bk, split_k=split)
    want = k.linear_ref(x.float(), w.float())
    assert got.dtype == dtype and got.shape == (rows, n_size)
    torch.testing.assert_close(
        got.float(), want, rtol=0, atol=(1e-5 if dtype == torch.float32 else 2e-3)
    )


@interpreted
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("per_sm", [1, 2])
@pytest.mark.parametrize("rows,n_size,k_size", [(1, 83, 64), (3, 8, 48), (17, 40, 80)])
def test_interpreted_ragged_rows_match_reference(rows, n_size, k_size, per_sm, split):
    # Rows shared out evenly among programs_per_sm x 8 programs (the interpreter's SM count):
    # 83 rows over 8 or 16 programs (shares of 10-11 and 5-6), fewer rows than programs (8
    # over 16), a split K; every row written once, none twice.
    x, w = _inputs(rows, n_size, k_size, torch.float32)
    got = k.skinny_gemm(
        x, w, mode="swap", block_m=16, block_n=16, block_k=16, split_k=split,
        programs_per_sm=per_sm,
    )  # fmt: skip
    torch.testing.assert_close(got, k.linear_ref(x, w), rtol=0, atol=1e-5)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,n_size,k_size", [(1, 40, 80), (3, 48, 72)])
@pytest.mark.parametrize("name", ["swap", "swap_split3", "dot_split2", "fma"])
def test_interpreted_tma_weight_loads_match_pointer_loads(name, rows, n_size, k_size, dtype):
    # The weight's tiles through a tensor descriptor: a partial last N tile and a K tail
    # arrive as zeros where the pointer loads' masks gave zeros, so the output is the same,
    # bit for bit.
    mode, bm, bn, bk, split = CONFIGS[name]
    x, w = _inputs(rows, n_size, k_size, dtype)
    config = dict(mode=mode, block_m=bm, block_n=bn, block_k=bk, split_k=split)
    assert torch.equal(k.skinny_gemm(x, w, tma=True, **config), k.skinny_gemm(x, w, **config))


@interpreted
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("rows,n_size,k_size", [(1, 40, 80), (3, 48, 72)])
def test_interpreted_tma_fused_norm_matches_pointer_loads(rows, n_size, k_size, gated):
    # Gated, a program's up rows come through the same descriptor, N rows below its gate rows.
    x, w = _inputs(rows, 2 * n_size if gated else n_size, k_size, torch.float16)
    residual, norm_weight = _norm_inputs(rows, k_size, torch.float16)
    config = dict(mode="swap", block_m=16, block_n=16, block_k=16)
    args = (x, residual, norm_weight, 1e-5, w)
    got = k.add_rms_norm_gemm(*args, gated=gated, tma=True, **config)
    want = k.add_rms_norm_gemm(*args, gated=gated, **config)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@interpreted
def test_interpreted_tma_refuses_what_it_cannot_load():
    x, w = _inputs(1, 40, 80, torch.float16)
    with pytest.raises(k.SkinnyGemmError, match="whole tiles"):
        k.skinny_gemm(x, w, block_n=16, block_k=16, programs_per_sm=1, tma=True)
    # Rows of 81 half-precision elements: a 162-byte stride, which TMA cannot step.
    wide = torch.cat([w, w[:, :1]], dim=1)[:, 1:]
    assert wide.stride() == (81, 1)
    with pytest.raises(k.SkinnyGemmError, match="16-byte aligned"):
        k.skinny_gemm(x, wide, block_n=16, block_k=16, tma=True)


@interpreted
def test_interpreted_split_counters_reset_between_calls():
    # The last program of a tile zeroes its counter: a second call must sum afresh.
    x, w = _inputs(2, 32, 96, torch.float32)
    first = k.skinny_gemm(x, w, mode="swap", block_m=16, block_n=16, block_k=16, split_k=3)
    second = k.skinny_gemm(x, w, mode="swap", block_m=16, block_n=16, block_k=16, split_k=3)
    assert torch.equal(first, second)
    assert int(k._counters(x.device).abs().sum()) == 0


@interpreted
def test_interpreted_op_dispatches_by_table(use_table, monkeypatch):
    swap = {"kernel": "triton", "mode": "swap", "block_m": 16, "block_n": 16, "block_k": 16,
            "split_k": 2, "num_warps": 4, "num_stages": 2}  # fmt: skip
    config = use_table(table_of({(24, 32, 1): swap, (24, 32, 16): {"kernel": "cublas"},
                                 (24, 32, 64): {"kernel": "cublaslt"}}))  # fmt: skip
    launched = []
    real = k.skinny_gemm
    monkeypatch.setattr(k, "skinny_gemm", lambda *a, **kw: launched.append(kw) or real(*a, **kw))
    for rows, runs_kernel in ((1, True), (2, True), (9, False), (40, False), (300, False)):
        x, w = _inputs(rows, 24, 32, torch.float16)
        launched.clear()
        got = k.linear(x, w, config.key)  # the op, as the pass emits it
        torch.testing.assert_close(
            got.float(), k.linear_ref(x.float(), w.float()), rtol=0, atol=2e-3
        )
        assert bool(launched) == runs_kernel, rows
        assert all(kw["kernel_config"].key == config.key for kw in launched)  # PDL settings too
    x, w = _inputs(1, 40, 32, torch.float16)  # a weight the table does not know: cuBLAS
    launched.clear()
    k.linear(x, w, config.key)
    assert not launched
    x, w = _inputs(1, 24, 32, torch.float16)  # the shipped table does not know it either
    k.linear(x, w, tuning.default().key)
    assert not launched


def _norm_inputs(rows: int, k_size: int, dtype: torch.dtype, device: str = "cpu"):
    gen = torch.Generator(device=device).manual_seed(rows * 7 + k_size)
    residual = torch.randn(rows, k_size, generator=gen, device=device).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(k_size, generator=gen, device=device)).to(dtype)
    return residual, norm_weight


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,n_size,k_size", [(1, 40, 80), (3, 48, 72), (16, 24, 64)])
@pytest.mark.parametrize(
    "name,gated",
    [(name, False) for name in CONFIGS] + [(n, True) for n, c in CONFIGS.items() if c[4] == 1],
)
def test_interpreted_fused_norm_matches_reference(name, gated, rows, n_size, k_size, dtype):
    # rms_norm(x + residual) fused into the GEMM, in one pass (unsplit) or two (split), and,
    # gated, silu_and_mul of the [gate; up] product as its epilogue: the output against the
    # norm, F.linear (and silu_and_mul) within the dtype's rounding, the residual sum (written
    # by the first weight rows' programs, every K-slice of a split) exactly the reference's.
    mode, bm, bn, bk, split = CONFIGS[name]  # gated: no split-K
    x, w = _inputs(rows, 2 * n_size if gated else n_size, k_size, dtype)
    residual, norm_weight = _norm_inputs(rows, k_size, dtype)
    got, summed = k.add_rms_norm_gemm(
        x, residual, norm_weight, 1e-5, w, gated=gated, mode=mode, block_m=bm, block_n=bn,
        block_k=bk, split_k=split,
    )  # fmt: skip
    want, want_summed = k.add_rms_norm_linear_ref(x, residual, norm_weight, 1e-5, w, gated)
    assert torch.equal(summed, want_summed)
    assert got.dtype == dtype and got.shape == (rows, n_size)
    torch.testing.assert_close(
        got.float(), want.float(), rtol=0, atol=(1e-5 if dtype == torch.float32 else 4e-3)
    )


@interpreted
def test_interpreted_check_of_every_inner_product_through_the_harness():
    # The spec's check: the tuned choice (here F.linear: no entry for these weights) and every
    # MODE, a split that divides K's tiles and one that does not, relative to the output.
    assert check(spec_of("skinny_gemm")) < 1e-5


@interpreted
@pytest.mark.parametrize("per_sm", [1, 2])
@pytest.mark.parametrize("rows", [1, 3])
def test_interpreted_fused_norm_with_ragged_rows(rows, per_sm):
    # The plain fused launch with the weight rows shared out evenly among per_sm x 8 programs
    # (the interpreter's SM count; 40 rows: 5 or 2-3 a program), as the gemm-norm sweep tries
    # it for qkv: the same output and residual sum as the reference.
    x, w = _inputs(rows, 40, 64, torch.float32)
    residual, norm_weight = _norm_inputs(rows, 64, torch.float32)
    got, summed = k.add_rms_norm_gemm(
        x, residual, norm_weight, 1e-5, w, mode="swap", block_m=16, block_n=8, block_k=32,
        programs_per_sm=per_sm,
    )  # fmt: skip
    want, want_summed = k.add_rms_norm_linear_ref(x, residual, norm_weight, 1e-5, w, False)
    assert torch.equal(summed, want_summed)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@interpreted
@pytest.mark.parametrize("gated", [False, True])
def test_interpreted_fused_norm_op_dispatches_by_rows(use_table, monkeypatch, gated):
    # Fused where the nearest entry of this weight has a `fused` record for the launch kind
    # and the rows are few; the norm, the table's GEMM (and silu_and_mul) otherwise: here no
    # gated record at 8 rows, no record at all at 32, and above NORM_MAX_ROWS even where one
    # exists; the same two outputs either way, and the record's config is the one launched.
    def swap(split_k, block_n=16):
        return {"mode": "swap", "block_m": 16, "block_n": block_n, "block_k": 16,
                "split_k": split_k, "num_warps": 4, "num_stages": 2}  # fmt: skip

    both = {"plain": swap(2), "gated": swap(1, block_n=32)}
    config = use_table(
        table_of(
            {(24, 32, m): {"kernel": "triton", **swap(1)} for m in (1, 8, 16, 64)}
            | {(24, 32, 32): {"kernel": "cublas"}},
            fused={(24, 32, 1): both, (24, 32, 8): {"plain": swap(1)}, (24, 32, 16): both,
                   (24, 32, 64): both},
        )
    )  # fmt: skip
    fused = []
    real = k.add_rms_norm_gemm
    monkeypatch.setattr(k, "add_rms_norm_gemm", lambda *a, **kw: fused.append(kw) or real(*a, **kw))
    cases = ((1, True), (8, not gated), (16, True), (17, False), (32, False), (64, False))
    for rows, runs_fused in cases:
        x, w = _inputs(rows, 24, 32, torch.float16)
        residual, norm_weight = _norm_inputs(rows, 32, torch.float16)
        fused.clear()
        got, summed = k.add_rms_norm_linear(x, residual, norm_weight, 1e-6, w, gated, config.key)
        want, want_summed = k.add_rms_norm_linear_ref(x, residual, norm_weight, 1e-6, w, gated)
        assert torch.equal(summed, want_summed)
        assert got.shape == (rows, 12 if gated else 24)
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=4e-3)
        assert bool(fused) == runs_fused, rows
        if fused and rows == 1:
            assert fused[0]["block_n"] == (32 if gated else 16), fused
            assert fused[0]["split_k"] == (1 if gated else 2), fused
            assert fused[0]["kernel_config"].key == config.key


def test_fused_norm_refuses_what_it_cannot_fuse():
    x, w = _inputs(2, 8, 16, torch.float32)
    residual, norm_weight = _norm_inputs(2, 16, torch.float32)
    with pytest.raises(k.SkinnyGemmError, match="must match x"):
        k.add_rms_norm_gemm(x, residual.half(), norm_weight, 1e-5, w)
    with pytest.raises(k.SkinnyGemmError, match="norm weight"):
        k.add_rms_norm_gemm(x, residual, norm_weight[:8], 1e-5, w)
    big_x, big_w = _inputs(k.NORM_MAX_ROWS + 1, 8, 16, torch.float32)
    big_r, _ = _norm_inputs(k.NORM_MAX_ROWS + 1, 16, torch.float32)
    with pytest.raises(k.SkinnyGemmError, match="at most"):
        k.add_rms_norm_gemm(big_x, big_r, norm_weight, 1e-5, big_w)
    with pytest.raises(k.SkinnyGemmError, match="gated launch needs"):
        k.add_rms_norm_gemm(x, residual, norm_weight, 1e-5, w, gated=True, split_k=2)
    odd_x, odd_w = _inputs(2, 7, 16, torch.float32)
    with pytest.raises(k.SkinnyGemmError, match="gated launch needs"):
        k.add_rms_norm_gemm(odd_x, residual, norm_weight, 1e-5, odd_w, gated=True)


def test_fused_norm_op_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    key = tuning.default().key
    with FakeTensorMode():
        x, r, g, w = torch.empty(7, 32), torch.empty(7, 32), torch.empty(32), torch.empty(48, 32)
        out, summed = torch.ops.ce_kernels.add_rms_norm_linear(x, r, g, 1e-5, w, False, key)
        gated, _ = torch.ops.ce_kernels.add_rms_norm_linear(x, r, g, 1e-5, w, True, key)
    assert out.shape == (7, 48) and summed.shape == (7, 32) and gated.shape == (7, 24)


@pytest.mark.parametrize("mode", ["swap", "dot", "fma"])
def test_parent_process_refuses_cpu_tensors(mode):
    if k.INTERPRETED:
        pytest.skip("the interpreter runs CPU tensors")
    x, w = _inputs(1, 16, 16, torch.float32)
    with pytest.raises(k.SkinnyGemmError, match="TRITON_INTERPRET"):
        k.skinny_gemm(x, w, mode=mode)
    # The op never launches it there: F.linear.
    torch.testing.assert_close(k.linear(x, w, tuning.default().key), k.linear_ref(x, w))


# --------------------------------------------------------------------------- the tuned choice


def test_config_for_needs_exact_weight_and_takes_nearest_bucket(use_table):
    tri = {"kernel": "triton", "mode": "swap", "block_n": 64}
    key = use_table(table_of({(6144, 4096, 1): tri, (6144, 4096, 64): {"kernel": "cublaslt"},
                              (4096, 4096, 1): {**tri, "block_n": 32}})).key  # fmt: skip
    assert k.config_for(key, "h100", 6144, 4096, 1) == ("triton", {"mode": "swap", "block_n": 64})
    assert k.config_for(key, "h100", 6144, 4096, 4) == ("triton", {"mode": "swap", "block_n": 64})
    assert k.config_for(key, "h100", 6144, 4096, 32) == ("cublaslt", {})  # nearer 64
    assert k.config_for(key, "h100", 4096, 4096, 1) == ("triton", {"mode": "swap", "block_n": 32})
    assert k.config_for(key, "h100", 6144, 8192, 1) == ("cublas", {})  # unknown K
    assert k.config_for(key, "cpu", 6144, 4096, 1) == ("cublas", {})


def test_unknown_kernel_in_table_is_an_error(use_table):
    config = use_table(table_of({(64, 64, 1): {"kernel": "cutlass"}}))
    with pytest.raises(k.SkinnyGemmError, match="skinny_gemm_0.json: unknown kernel 'cutlass'"):
        k.config_for(config.key, "h100", 64, 64, 1)


def test_blas_library_is_restored(monkeypatch):
    # CPU builds refuse cuBLASLt, so the flag is recorded instead of set.
    state = ["cublas"]
    monkeypatch.setattr(
        torch.backends.cuda,
        "preferred_blas_library",
        lambda name=None: state[-1] if name is None else state.append(name),
    )
    with pytest.raises(ValueError), k.blas_library("cublaslt"):
        assert state[-1] == "cublaslt"
        raise ValueError
    assert state == ["cublas", "cublaslt", "cublas"]


def test_shipped_table_loads_with_valid_configs():
    from dataclasses import fields

    table = tuning.default().table("skinny_gemm")  # configs/skinny_gemm.json
    assert table.key_names == ("N", "K", "M") and table.default == {"kernel": "cublas"}
    params = {f.name for f in fields(k.LaunchConfig)}
    for entry in table.targets["h100"].entries:
        config = dict(entry.config)
        assert config.pop("kernel") in k.KERNELS
        assert set(config) <= params, entry.key
        assert config.get("mode", "swap") in k.MODES


def test_fake_gives_the_linear_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.ops.ce_kernels.skinny_linear(
            torch.empty(7, 32), torch.empty(48, 32), tuning.default().key
        )
    assert out.shape == (7, 48) and out.dtype == torch.float32


@pytest.mark.slow
def test_cpu_kernel_cases_in_one_child():
    if k.INTERPRETED:
        pytest.skip("this is the child")
    from pass_kit import run_interpreted

    passes = HERE.parent / "passes"
    pass_tests = [
        str(passes / f) for f in ("test_skinny_gemm_pass.py", "test_add_rms_norm_into_gemm.py")
    ]
    child = run_interpreted(Path(__file__), "TRITON_INTERPRET", *pass_tests, "-k", "interpreted")
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-4000:]
    summary = child.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, child.stdout[-2000:]


# --------------------------------------------------------------------------- GPU


def _tuned_cells(kernel: str) -> list[tuple[dict, dict]]:
    table = tuning.default().table("skinny_gemm")
    section = table.targets.get("h100")
    cells = []
    for entry in section.entries if section else []:
        config = dict(entry.config)
        if config.pop("kernel") == kernel:
            cells.append((entry.key, config))
    return cells


@pytest.mark.gpu
@requires_cuda
def test_gpu_tuned_configs_match_cublas():
    cells = _tuned_cells("triton")
    if not cells:
        pytest.skip("no Triton entry in the h100 table: cuBLAS everywhere")
    for key, config in cells:
        x, w = _inputs(key["M"], key["N"], key["K"], torch.bfloat16, "cuda")
        assert _rel(k.skinny_gemm(x, w, **config), k.linear_ref(x, w)) < 1e-2, key
        assert _rel(k.linear(x, w, tuning.default().key), k.linear_ref(x, w)) < 1e-2, key


@pytest.mark.gpu
@requires_cuda
def test_gpu_cublaslt_cells_match_and_restore_the_library():
    cells = _tuned_cells("cublaslt")
    if not cells:
        pytest.skip("no cuBLASLt entry in the h100 table")
    before = torch.backends.cuda.preferred_blas_library()
    for key, _ in cells:
        x, w = _inputs(key["M"], key["N"], key["K"], torch.bfloat16, "cuda")
        assert _rel(k.linear(x, w, tuning.default().key), k.linear_ref(x, w)) < 1e-2, key
        assert torch.backends.cuda.preferred_blas_library() == before


@pytest.mark.gpu
@requires_cuda
def test_gpu_fused_norm_matches_reference_in_tuned_cells():
    # Every cell of the table with a `fused` record (bench gemm-norm), through the op as the
    # engine calls it, eager and replayed in a CUDA graph: the residual sum bit-equal to the
    # reference's; the output as close to the exact (float32) result as the bf16 reference
    # is, give or take one rounding: the fused launch rounds elsewhere (the normalised row
    # not before the weight scales it), and gated, silu(gate) * up compounds two roundings.
    config = tuning.default()
    table = config.table("skinny_gemm")
    cells = [
        (entry.key, kind)
        for entry in table.targets["h100"].entries
        for kind in entry.info.get("fused", {})
    ]
    if not cells:
        pytest.skip("no fused record in the h100 table: the op never fuses")
    for key, kind in cells:
        x, w = _inputs(key["M"], key["N"], key["K"], torch.bfloat16, "cuda")
        residual, norm_weight = _norm_inputs(key["M"], key["K"], torch.bfloat16, "cuda")
        args = (x, residual, norm_weight, 1e-5, w, kind == "gated")
        assert k.fused_config(config, x, w, kind == "gated") is not None, (key, kind)
        want, want_summed = k.add_rms_norm_linear_ref(*args)
        got, summed = k.add_rms_norm_linear(*args, config.key)
        assert torch.equal(summed, want_summed), (key, kind)
        exact = k.add_rms_norm_linear_ref(*(a.float() if torch.is_tensor(a) else a for a in args))
        err, ref_err = _rel(got, exact[0]), _rel(want, exact[0])
        assert err < 2 * ref_err + 2**-8, (key, kind, err, ref_err)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed, replayed_summed = k.add_rms_norm_linear(*args, config.key)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, got), (key, kind)
        assert torch.equal(replayed_summed, summed), (key, kind)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    "n_size,k_size,split,gated",
    [(6144, 4096, 1, False), (4096, 4096, 2, False), (4096, 14336, 4, False),
     (28672, 4096, 1, True)],
)  # fmt: skip
@pytest.mark.parametrize("rows", [1, 4])
def test_gpu_tma_matches_pointer_loads(rows, n_size, k_size, split, gated):
    # On the H200's TMA unit, at the Llama-3-8B layer shapes (qkv with its norm, o_proj and
    # down split, gate_up gated): bit-equal to the pointer loads, eager and in a CUDA graph.
    x, w = _inputs(rows, 2 * n_size if gated else n_size, k_size, torch.bfloat16, "cuda")
    residual, norm_weight = _norm_inputs(rows, k_size, torch.bfloat16, "cuda")
    config = dict(mode="swap", block_m=16, block_n=64, block_k=128, split_k=split)

    def run(tma: bool):
        if split > 1:
            return (k.skinny_gemm(x, w, tma=tma, **config),)
        return k.add_rms_norm_gemm(
            x, residual, norm_weight, 1e-5, w, gated=gated, tma=tma, **config
        )

    want = run(False)
    got = run(True)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = run(True)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(replayed, want, strict=True))


@pytest.mark.gpu
@requires_cuda
def test_gpu_split_k_graph_replay_is_deterministic():
    x, w = _inputs(4, 4096, 14336, torch.bfloat16, "cuda")
    config = dict(mode="swap", block_m=16, block_n=64, block_k=128, split_k=7)
    want = k.skinny_gemm(x, w, **config)  # eager first: allocates the counters
    assert _rel(want, k.linear_ref(x, w)) < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = k.skinny_gemm(x, w, **config)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("n_size,k_size", [(4096, 4096), (6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("per_sm", [1, 2])
def test_gpu_ragged_rows_match_cublas(n_size, k_size, per_sm):
    x, w = _inputs(1, n_size, k_size, torch.bfloat16, "cuda")
    got = k.skinny_gemm(x, w, mode="swap", block_m=16, block_k=256, programs_per_sm=per_sm)
    assert _rel(got, k.linear_ref(x, w)) < 1e-2


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("tiles", [0, 1, 2])
@pytest.mark.parametrize("rows", [1, 4])
def test_gpu_pdl_chain_gives_the_same_output(rows, tiles):
    # PDL on (the default on sm_90): attention, the skinny GEMMs and silu_and_mul launch as
    # PDL dependents, each waiting for the kernel ahead before it touches memory and
    # releasing the next after its main loop; each GEMM program first puts the config's
    # leading K-tiles of its weight slice into L2 (none, one, two). Eager and in a CUDA graph,
    # the output must be the one without PDL, bit for bit.
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    import compile_engine.kernels_generated.paged_attention as pa
    from compile_engine.benchmarks.attention_inputs import make_batch
    from compile_engine.kernels_generated.device import pdl_on
    from compile_engine.kernels_generated.silu_and_mul import silu_and_mul_triton

    heads = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
    batch = make_batch([1] * rows, [100] * rows, dtype=torch.bfloat16, device="cuda", **heads)
    x, w_o = _inputs(1, 4096, 4096, torch.bfloat16, "cuda")
    _, w_up = _inputs(2, 4096, 4096, torch.bfloat16, "cuda")
    _, w_down = _inputs(1, 4096, 2048, torch.bfloat16, "cuda")
    launch = dict(mode="swap", block_m=16, block_n=64, block_k=256, num_stages=4)

    def layer(config: KernelConfig) -> torch.Tensor:
        out = pa.paged_attention_triton(*batch.args(), kernel_config=config)
        hidden = k.skinny_gemm(out.reshape(out.shape[0], -1), w_o, kernel_config=config, **launch)
        up = k.skinny_gemm(hidden, w_up, kernel_config=config, **launch)
        act = silu_and_mul_triton(up, kernel_config=config)
        return k.skinny_gemm(act, w_down, split_k=2, kernel_config=config, **launch)

    off, on = KernelConfig(pdl=False), KernelConfig(pdl_prefetch_tiles=tiles)
    cuda = torch.device("cuda")
    assert not pdl_on(off, cuda, rows) and pdl_on(on, cuda, rows)
    assert k.prefetch_tiles(on, x, 256, even_k=True) == tiles
    want = layer(off)
    assert torch.equal(layer(on), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = layer(on)
    for _ in range(3):  # the split-K counters must come back to zero every time
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)


def test_pdl_prefetch_tiles_by_config_and_launch():
    # A PDL launch's PREFETCH: the config's pdl_prefetch_tiles leading K-tiles of the weight
    # slice (one by default, 0 none), where the prefetch covers whole 128-byte lines of
    # half-precision rows: never for an uneven K split, a BLOCK_K that is not a multiple of
    # 64, or float32.
    x = torch.empty(1, 4096, dtype=torch.bfloat16, device="meta")
    two = KernelConfig(pdl_prefetch_tiles=2)
    assert k.prefetch_tiles(tuning.default(), x, 256, even_k=True) == 1
    assert k.prefetch_tiles(KernelConfig(pdl_prefetch_tiles=0), x, 256, even_k=True) == 0
    assert k.prefetch_tiles(two, x, 256, even_k=True) == 2
    assert k.prefetch_tiles(two, x, 64, even_k=True) == 2
    assert k.prefetch_tiles(two, x.half(), 128, even_k=True) == 2
    assert k.prefetch_tiles(two, x, 256, even_k=False) == 0
    assert k.prefetch_tiles(two, x, 32, even_k=True) == 0
    assert k.prefetch_tiles(two, x, 96, even_k=True) == 0
    assert k.prefetch_tiles(two, x.float(), 256, even_k=True) == 0


def test_pdl_on_by_config_rows_and_device(monkeypatch):
    # On by default for sm_90+ CUDA devices and launches of at most pdl_max_rows (16) tokens;
    # never on CPU or older GPUs, nor with the config's pdl off.
    import compile_engine.kernels_generated.device as dev

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(dev, "_cuda_capability", lambda index: (9, 0))
    default = tuning.default()
    assert default.pdl and default.pdl_max_rows == 16
    assert dev.pdl_on(default, cuda, 1) and dev.pdl_on(default, cuda, 16)
    assert not dev.pdl_on(default, cuda, 17)
    assert not dev.pdl_on(default, torch.device("cpu"), 1)
    assert not dev.pdl_on(KernelConfig(pdl=False), cuda, 1)
    narrow = KernelConfig(pdl_max_rows=4)
    assert dev.pdl_on(narrow, cuda, 4) and not dev.pdl_on(narrow, cuda, 5)
    assert not dev.pdl_on(KernelConfig(pdl_max_rows=0), cuda, 1)
    assert dev.pdl_launch(True) == {"launch_pdl": True} and dev.pdl_launch(False) == {}
    monkeypatch.setattr(dev, "_cuda_capability", lambda index: (8, 0))
    assert not dev.pdl_on(default, cuda, 1)
