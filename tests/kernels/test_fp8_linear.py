"""The FP8 linear (kernels_generated/fp8_linear.py): on CUDA every path against its reference
(`fp8_linear_ref`), each scheme at the skinny rows and above, the activation quantized as the
graph quantizes it (`quantize_fp8_ref`); on CPU what can be checked without casting FP8 (the
Triton interpreter cannot): the refusal, the block-tile fitting, the table, the composition
with the quantization being quant_linear's reference. The CUDA cases carry the gpu marker and
skip without a device."""

from __future__ import annotations

import pytest
import torch

from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.skinny_gemm import LaunchConfig, SkinnyGemmError
from compile_engine.models.quant import (
    QuantScheme,
    quant_linear_ref,
    quantize_checkpoint_tensor,
    quantize_fp8_ref,
)

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
    x_q, x_s = quantize_fp8_ref(torch.randn(2, K))
    with pytest.raises(SkinnyGemmError, match="CUDA only"):
        fp8_linear(x_q, x_s, q, scale, None, "fp8_e4m3:channel:token", torch.float32, "k")


@pytest.mark.parametrize(("kind", "activation"), [("channel", "token"), ("tensor", "tensor"),
                                                  ("block", "none")])  # fmt: skip
def test_quantize_then_fp8_linear_is_quant_linear(kind, activation):
    from compile_engine.kernels_generated.fp8_linear import fp8_linear_ref

    q, scale = weight(kind, "cpu")
    scheme = str(QuantScheme(kind, activation, (128, 128) if kind == "block" else None))
    x = torch.randn(5, K)
    static = torch.tensor(8 / 448) if activation == "tensor" else None
    if activation == "none":
        x_q, x_s = x, None
    else:
        x_q, x_s = quantize_fp8_ref(x, static)
    got = fp8_linear_ref(x_q, x_s, q, scale, None, scheme, torch.float32)
    assert torch.equal(got, quant_linear_ref(x, q, scale, static, None, scheme))


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
    if activation == "none":
        x_q, x_s = x, None
    else:
        static = torch.tensor(8 / 448, device="cuda") if activation == "tensor" else None
        x_q, x_s = quantize_fp8_ref(x, static)
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    bf16 = torch.bfloat16
    got = run_fp8_linear(tuning.default(), x_q, x_s, q, scale, bias, scheme, bf16)
    want = fp8_linear_ref(x_q, x_s, q, scale, bias, scheme, bf16)
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
@pytest.mark.parametrize(("kind", "activation"), [("channel", "token"), ("block", "none"),
                                                  ("block", "token")])  # fmt: skip
def test_skinny_launch_configs(config, kind, activation):
    # The tuned table's kinds of entry: split-K partials scaled before their sum, TMA tiles,
    # the fma path, per-K-tile block scales under a split; FP8 and bf16 activations.
    from compile_engine.kernels_generated.fp8_linear import _fit_block, fp8_linear_ref
    from compile_engine.kernels_generated.skinny_gemm import Fp8Operands, _launch

    q, scale = weight(kind, "cuda", 256, 1024)
    scheme = QuantScheme(kind, activation, (128, 128) if kind == "block" else None)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    x_q, x_s = (x, None) if activation == "none" else quantize_fp8_ref(x)
    launch = _fit_block(LaunchConfig(**config), scheme)
    flat_scale = x_s.reshape(-1) if x_s is not None else None
    operands = Fp8Operands(scale, kind, torch.bfloat16, flat_scale, scheme.block)
    got = _launch(x_q, q, None, launch, tuning.default(), fp8=operands)[0]
    want = fp8_linear_ref(x_q, x_s, q, scale, None, str(scheme), torch.bfloat16)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    again = _launch(x_q, q, None, launch, tuning.default(), fp8=operands)[0]  # counters reset
    assert torch.equal(again, got)
