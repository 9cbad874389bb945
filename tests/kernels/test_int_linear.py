"""The integer weight-only Triton GEMM (kernels_generated/int_linear.py) against quant_linear's
reference: every weight format it runs, the fma / dot / tiles launches, split-K, bias, a
GPTQ checkpoint's weights as the loader repacks them. CPU cases run interpreted, tiny, in the
one TRITON_INTERPRET=1 child of tests/kernels/test_triton_fusions_interpreted.py; the GPU cases
(gpu marker) at the Llama-3-8B shapes in bf16, and under CUDA-graph replay with split-K."""

from __future__ import annotations

import pytest
import torch

from compile_engine.kernels_generated import int_linear as k
from compile_engine.kernels_generated.tuning import KernelConfig
from compile_engine.models.quant import QuantScheme, pack_int4, quant_linear_ref

interpreted = pytest.mark.interpreted_child("TRITON_INTERPRET")
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or k.INTERPRETED,
    reason="needs CUDA (and compiled, not interpreted, Triton)",
)
CONFIG = KernelConfig()  # the shipped tables


def make_weight(weight: str, group: int, n: int, kk: int, device: str = "cpu", seed: int = 0):
    """Random codes and scales of a scheme, in its plain layout."""
    scheme = QuantScheme("group", "none", weight=weight, group=group)
    gen = torch.Generator().manual_seed(seed)
    levels = 16 if scheme.bits == 4 else 256
    codes = torch.randint(0, levels, (n, kk), generator=gen)
    scale = torch.rand(n, kk // group, generator=gen) * 0.02 + 0.001
    if scheme.has_zero:
        zero = torch.randint(0, levels, (n, kk // group), generator=gen).float()
        scale = torch.stack([scale, zero], dim=-1)
    if scheme.bits == 4:
        w = pack_int4(codes, "plain")
    elif weight == "int8":
        w = (codes - 128).to(torch.int8)
    else:
        w = codes.to(torch.uint8)
    return w.to(device), scale.float().to(device), str(scheme)


def launch(mode: str, block_m: int, split: int = 0, dequant: str = "convert",
           swap: bool = False, block_k: int = 32, block_n: int = 16) -> k.IntLaunch:  # fmt: skip
    return k.IntLaunch(mode, block_m, block_n, block_k, num_warps=1, num_stages=1,
                       programs_per_sm=split, dequant=dequant, swap=swap)  # fmt: skip


CASES = [  # (weight, group, rows, launch)
    ("int4", 32, 1, launch("fma", 1)),
    ("int8", 32, 3, launch("fma", 1)),
    ("uint4_zp", 64, 2, launch("fma", 1, split=4)),
    ("uint8_zp", 32, 1, launch("fma", 1)),
    # fma tiles of 8 and 16 words (a tile in one group; a longer launch block_k is clamped)
    ("int4", 128, 3, launch("fma", 1, block_k=128)),
    ("int8", 32, 1, launch("fma", 1, block_k=128, block_n=32)),
    ("int8", 64, 2, launch("fma", 1, split=2, block_k=64)),
    ("uint4_zp", 64, 1, launch("fma", 1, block_k=64, block_n=32)),  # 48 rows: a masked tail
    ("int8", 32, 4, launch("dot", 16, swap=True)),
    ("uint4_zp", 64, 18, launch("dot", 16, split=2, swap=True)),
    ("uint8_zp", 32, 5, launch("dot", 16)),
    ("int4", 64, 17, launch("dot", 16, split=2)),
    ("uint4_zp", 32, 20, launch("dot", 16)),
]


@interpreted
@pytest.mark.parametrize(("weight", "group", "rows", "config"), CASES)
def test_interpreted_matches_reference(weight, group, rows, config) -> None:
    n, kk = 48, 128
    w, s, scheme = make_weight(weight, group, n, kk)
    x = torch.randn(rows, kk)
    bias = torch.randn(n) if rows == 5 else None
    got = k.run_int_linear(CONFIG, x, w, s, bias, scheme, config)
    want = quant_linear_ref(x, w, s, None, bias, scheme)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@interpreted
def test_interpreted_float16_dot_and_table_defaults() -> None:
    w, s, scheme = make_weight("int4", 32, 32, 64)
    x = torch.randn(16, 64).half()
    got = k.run_int_linear(CONFIG, x, w, s, None, scheme, launch("dot", 16))
    want = quant_linear_ref(x, w, s, None, None, scheme)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)
    default = k.launch_config(CONFIG.key, 4096, 1024, 1)  # a shape the table has no entry of
    assert default.mode == "fma" and k.launch_config(CONFIG.key, 1, 1, 64).block_m
    # the fma form reads the weight once a row: two rows take a dot entry, tuned or default
    assert k.launch_config(CONFIG.key, 4096, 1024, 2).mode == "dot"
    assert k.launch_config(CONFIG.key, 4096, 4096, 1).mode == "fma"
    assert k.launch_config(CONFIG.key, 4096, 4096, 2).mode == "dot"
    entries = CONFIG.table("int_gemm").targets["h100"].entries  # swept on the H200
    (o_proj,) = [e for e in entries if (e.key["N"], e.key["K"], e.key["M"]) == (4096, 4096, 1)]
    assert k.launch_config(CONFIG.key, 4096, 4096, 1) == k.IntLaunch(**o_proj.config)


@interpreted
@pytest.mark.parametrize("weight", ["int4", "uint4_zp"])
@pytest.mark.parametrize(("rows", "split", "swap"), [(1, 0, False), (5, 2, True), (17, 0, False)])
def test_interpreted_mantissa_dequant_matches_reference(weight, rows, split, swap) -> None:
    # dequant "bits": codes OR-ed into an fp16 mantissa (bf16's on the GPU cases), one dot.
    w, s, scheme = make_weight(weight, 32, 48, 128, seed=rows)
    x = torch.randn(rows, 128).half()
    config = launch("dot", 16, split, "bits", swap)
    got = k.run_int_linear(CONFIG, x, w, s, None, scheme, config)
    want = quant_linear_ref(x, w, s, None, None, scheme)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)
    with pytest.raises(k.IntLinearError, match="bf16 / fp16 activations"):
        k.run_int_linear(CONFIG, x.float(), w, s, None, scheme, launch("dot", 16, 0, "bits"))


def test_refuses_what_it_does_not_run() -> None:
    w, s, _ = make_weight("int4", 32, 32, 64)
    with pytest.raises(k.IntLinearError, match="plain layout"):
        k.run_int_linear(CONFIG, torch.randn(1, 64), w, s, None,
                         "uint4:group32:none")  # fmt: skip
    if not k.INTERPRETED:
        with pytest.raises(k.IntLinearError, match="CUDA"):
            k.run_int_linear(CONFIG, torch.randn(1, 64), w, s, None,
                             "int4:group32:none")  # fmt: skip


# --------------------------------------------------------------------------- GPU

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}  # fmt: skip


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("weight", ["int4", "int8", "uint4_zp"])
@pytest.mark.parametrize("rows", [1, 4, 16, 64, 300])
def test_gpu_llama3_shapes_match_reference(weight: str, rows: int) -> None:
    for name, (n, kk) in SHAPES.items():
        if rows == 300 and name != "down":
            continue  # one shape is enough for the tile path at many rows
        w, s, scheme = make_weight(weight, 128, n, kk, "cuda")
        x = torch.randn(rows, kk, device="cuda").bfloat16()
        got = k.int_linear(x, w, s, None, scheme, CONFIG.key)
        want = quant_linear_ref(x.float(), w, s, None, None, scheme)
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        assert err < 1e-2, (name, err)  # the output's bf16 rounding


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("weight", ["int4", "uint4_zp"])
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_gpu_mantissa_dequant_matches_reference(weight: str, rows: int) -> None:
    for name, (n, kk) in SHAPES.items():
        w, s, scheme = make_weight(weight, 128, n, kk, "cuda")
        x = torch.randn(rows, kk, device="cuda").bfloat16()
        config = k.IntLaunch("dot", 16 if rows <= 16 else 64, 128 if rows <= 16 else 64, 128,
                             num_warps=4, num_stages=4, programs_per_sm=2 if rows <= 16 else 0,
                             dequant="bits")  # fmt: skip
        got = k.run_int_linear(CONFIG, x, w, s, None, scheme, config)
        want = quant_linear_ref(x.float(), w, s, None, None, scheme)
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        assert err < 1e-2, (name, err)


@pytest.mark.gpu
@requires_cuda
def test_gpu_split_k_replays_in_a_cuda_graph() -> None:
    w, s, scheme = make_weight("int4", 128, 4096, 14336, "cuda")
    x = torch.randn(1, 14336, device="cuda").bfloat16()
    key = CONFIG.key
    first = k.int_linear(x, w, s, None, scheme, key)  # eager: the counters exist
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = k.int_linear(x, w, s, None, scheme, key)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)
