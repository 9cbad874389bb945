"""The FP8 linear (kernels_generated/fp8_linear.py): on CUDA every path against its reference
(`fp8_linear_ref`), each scheme at the skinny rows and above; on CPU what can be checked
without casting FP8 (the Triton interpreter cannot): the refusal, the block-tile fitting, the
table. The CUDA cases carry the gpu marker and skip without a device."""

from __future__ import annotations

import pytest
import torch

from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.skinny_gemm import LaunchConfig, SkinnyGemmError
from compile_engine.models.quant import QuantScheme, quantize_checkpoint_tensor, quantize_fp8_ref

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
N, K = 384, 512  # three 128-row blocks, four 128-column blocks
LAYOUT = {"tensor": "ct-tensor", "channel": "ct-channel", "block": "ct-block"}


def weight(kind: str, device: str, n: int = N, k: int = K) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    w = torch.randn(n, k) * k**-0.5
    name = "model.layers.0.mlp.x_proj"
    parts = quantize_checkpoint_tensor(f"{name}.weight", w, LAYOUT[kind])
    q, scale = parts[f"{name}.weight"], parts[f"{name}.weight_scale"]
    shapes = {"tensor": (), "channel": (-1,), "block": scale.shape}
    return q.to(device), scale.reshape(shapes[kind]).to(device)


def test_cpu_tensors_are_refused():
    from compile_engine.kernels_generated.fp8_linear import fp8_linear

    q, scale = weight("channel", "cpu")
    with pytest.raises(SkinnyGemmError, match="CUDA only"):
        fp8_linear(torch.randn(2, K), q, scale, None, None, "fp8_e4m3:channel:token", "k")


def test_block_configs_fit_their_scale_blocks():
    from compile_engine.kernels_generated.fp8_linear import _fit_block

    block = QuantScheme("block", "none", (128, 128))
    wide = LaunchConfig(block_k=512, split_k=2)
    assert _fit_block(wide, block).block_k == 128 and _fit_block(wide, block).split_k == 2
    channel = QuantScheme("channel", "token")
    assert _fit_block(wide, channel) is wide
    table = tuning.default().table("fp8_gemm")
    LaunchConfig(**table.default["skinny"]), LaunchConfig(**table.default["tiles"])
    assert table.key_names == ("N", "K", "M")


SCHEMES = [
    ("tensor", "tensor"),
    ("tensor", "token"),
    ("channel", "token"),
    ("channel", "tensor"),
    ("channel", "none"),
    ("block", "none"),
    ("block", "token"),
]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64, 200])
@pytest.mark.parametrize(("kind", "activation"), SCHEMES)
def test_fp8_linear_matches_its_reference(kind, activation, rows):
    from compile_engine.kernels_generated.fp8_linear import fp8_linear_ref, run_fp8_linear

    q, scale = weight(kind, "cuda")
    scheme = str(QuantScheme(kind, activation, (128, 128) if kind == "block" else None))
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    input_scale = torch.tensor(8 / 448, device="cuda") if activation == "tensor" else None
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    got = run_fp8_linear(tuning.default(), x, q, scale, input_scale, bias, scheme)
    want = fp8_linear_ref(x, q, scale, input_scale, bias, scheme)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, N)
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err < 1e-2, f"{scheme} at {rows} rows: relative error {err:.2e}"


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(
    "config",
    [
        dict(mode="swap", block_n=64, block_k=256, split_k=2),
        dict(mode="swap", block_n=64, block_k=512, tma=True),
        dict(mode="fma", block_m=1, block_n=16, block_k=512),
        dict(mode="dot", block_m=16, block_n=64, block_k=128, split_k=4),
    ],
)
@pytest.mark.parametrize("kind", ["channel", "block"])
def test_skinny_launch_configs(config, kind):
    # The tuned table's kinds of entry: split-K partials scaled before their sum, TMA tiles,
    # the fma path, per-K-tile block scales under a split.
    from compile_engine.kernels_generated.fp8_linear import _fit_block, fp8_linear_ref
    from compile_engine.kernels_generated.skinny_gemm import Fp8Operands, _launch

    q, scale = weight(kind, "cuda", 256, 1024)
    scheme = QuantScheme(kind, "none", (128, 128) if kind == "block" else None)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    launch = _fit_block(LaunchConfig(**config), scheme)
    operands = Fp8Operands(scale, kind, torch.bfloat16, None, scheme.block)
    got = _launch(x, q, None, launch, tuning.default(), fp8=operands)[0]
    want = fp8_linear_ref(x, q, scale, None, None, str(scheme))
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    again = _launch(x, q, None, launch, tuning.default(), fp8=operands)[0]  # counters reset
    assert torch.equal(again, got)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("k_size", [64, 4096, 14336])
def test_quantize_rows_matches_the_reference(k_size):
    from compile_engine.kernels_generated.fp8_linear import quantize_rows

    x = torch.randn(7, k_size, device="cuda", dtype=torch.bfloat16) * 3
    x[2] = 0  # a zero row: zeros, not NaN
    q, scale = quantize_rows(x)
    q_ref, s_ref = quantize_fp8_ref(x)
    torch.testing.assert_close(scale, s_ref.reshape(-1))
    assert (q.float() - q_ref.float()).abs().le(q_ref.float().abs() * 2**-3).all()
    static = torch.tensor(0.01, device="cuda")
    q, s = quantize_rows(x, static)
    assert s.item() == pytest.approx(0.01) and q.float().abs().max().item() == 448.0
