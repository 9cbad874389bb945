"""Integer weight-only quant_linear (issue 29) on CPU: the schemes, the 4-bit layouts against
ATen's packer, GGUF Q4_0 / Q4_1 / Q8_0 blocks read without dequantizing (bit-equal to
gguf.quants.dequantize), a tiny quantized GGUF loaded kept quantized against its dequantized
float32 twin, and the errors. Tiny shapes, no Inductor compile (tests/kernels/ has the
kernels', tests/runtime/test_gguf_quantized.py the engine's)."""

from __future__ import annotations

import pathlib

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from gguf_models import SHAPE, tiny_llama_weights, write_quantized_gguf

from compile_engine.models import gguf as mg
from compile_engine.models.loader import dequantized_dtype, load_model
from compile_engine.models.quant import (
    QuantEmbedding,
    QuantizationError,
    QuantLinear,
    QuantScheme,
    dequantize_int_ref,
    int4pack_block_n,
    int4pack_scales,
    pack_int4,
    quant_linear_ref,
    unpack_int4,
    vnni_cpu_supported,
)

# The loading tests: a GGUF file stays quantized where our kernel runs or the CPU multiplies
# bfloat16 (models/loader.py); the layouts and references run anywhere.
kept_quantized = pytest.mark.skipif(
    dequantized_dtype(torch.device("cpu")) != torch.bfloat16 and not vnni_cpu_supported(),
    reason="GGUF stays quantized only where the CPU has AVX2 / AVX-512 VNNI or bfloat16",
)


def test_scheme_strings_round_trip_and_validate() -> None:
    for text in ("int4:group32:none", "uint4:group128:none:int4pack_cpu", "int8:group64:none"):
        assert str(QuantScheme.parse(text)) == text
    s = QuantScheme.parse("uint4:group32:none:int4pack_cpu")
    assert s.scale_shape(128, 64) == (2, 128, 2) and s.weight_shape(128, 64) == (128, 32)
    assert QuantScheme.parse("uint8:group32:none").scale_shape(8, 64) == (8, 2, 2)
    assert QuantScheme.parse("int8:group32:none").scale_shape(8, 64) == (8, 2)
    for bad in ("int4:group48:none", "int4:channel:none", "int8:group32:token",
                "int8:group32:none:int4pack_cpu", "fp8_e4m3:group32:none"):  # fmt: skip
        with pytest.raises(QuantizationError):
            QuantScheme.parse(bad)
    block = int4pack_block_n()  # 64 under AVX-512, 32 under AVX2
    with pytest.raises(QuantizationError, match=f"blocks of {block}"):
        s.check_shape(block + 16, 64)


@pytest.mark.parametrize("layout", ["plain", "int4pack_cpu"])
def test_int4_layouts_round_trip_and_match_aten(layout: str) -> None:
    codes = torch.randint(0, 16, (192, 96), dtype=torch.uint8)
    packed = pack_int4(codes, layout)
    assert packed.shape == (192, 48) and torch.equal(unpack_int4(packed, layout), codes)
    if layout == "int4pack_cpu":
        aten = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
        assert torch.equal(aten.view(torch.uint8).reshape(192, 48), packed)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_dequantize_bit_equal_to_gguf(kind: str) -> None:
    w = np.random.default_rng(1).standard_normal((64, 128), dtype=np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    blocks = quantize(w, qtype)
    codes, scales = mg.read_blocks(blocks, kind)
    scheme = QuantScheme("group", "none", weight=mg.QUANTIZED_TYPES[kind], group=32)
    weight = pack_int4(codes, "plain") if scheme.bits == 4 else codes
    ours = dequantize_int_ref(weight, scales, scheme)
    assert torch.equal(ours, torch.from_numpy(dequantize(blocks, qtype)))


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_k_and_5bit_blocks_dequantize_bit_equal_to_gguf(kind: str) -> None:
    """Random block bytes (every bit pattern of codes and 6-bit scales; finite float16 d,
    dmin), read by read_blocks, against gguf's own dequantize."""
    rng = np.random.default_rng(2)
    rows, size = 4, mg.BLOCK_BYTES[kind]
    per_row = 2  # blocks a row
    raw = rng.integers(0, 256, (rows * per_row, size), dtype=np.uint8)
    halves = rng.uniform(-0.1, 0.1, (rows * per_row, 2)).astype(np.float16).view(np.uint8)
    where = {"Q6_K": [208], "Q5_0": [0]}.get(kind, [0, 2])  # d (and dmin / m)
    for i, at in enumerate(where):
        raw[:, at : at + 2] = halves[:, 2 * i : 2 * i + 2]
    data = raw.reshape(rows, per_row * size)
    codes, scales = mg.read_blocks(data, kind)
    weight, group = mg.BLOCK_TYPES[kind]
    scheme = QuantScheme("group", "none", weight=weight, group=group)
    packed = pack_int4(codes, "plain") if scheme.bits == 4 else codes
    ours = dequantize_int_ref(packed, scales, scheme)
    want = dequantize(data, gguf.GGMLQuantizationType[kind])
    assert torch.equal(ours, torch.from_numpy(want))


@pytest.mark.parametrize("weight", ["int4", "uint4"])
def test_int4pack_scales_change_the_weight_by_their_rounding_only(weight: str) -> None:
    """The CPU layout's (scale, zero) in bfloat16 against the plain fp32 dequantization."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (128, 64), dtype=torch.uint8, generator=g)
    plain = QuantScheme("group", "none", weight=weight, group=32)
    shape = (128, 2, 2) if plain.has_min else (128, 2)
    scale = torch.rand(shape, generator=g) * 0.1 + 0.01
    if plain.has_min:
        scale[..., 1] = -8 * scale[..., 0]  # the weight's centre, as Q4_1 files mostly have
    exact = dequantize_int_ref(pack_int4(codes, "plain"), scale, plain)
    cpu = QuantScheme("group", "none", weight=weight, group=32, layout="int4pack_cpu")
    packed_scale = int4pack_scales(scale, plain, torch.bfloat16)
    ours = dequantize_int_ref(pack_int4(codes, "int4pack_cpu"), packed_scale, cpu)
    # bfloat16 keeps 8 bits: the scale is off by <= 2^-9 relative, times |q - 8| <= 8
    bound = (scale[..., 0].amax() * 8 * 2**-8).item()
    assert (ours - exact).abs().max().item() <= bound


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory) -> dict[str, pathlib.Path]:
    weights = tiny_llama_weights(seed=3)
    d = tmp_path_factory.mktemp("q4")
    return {k: write_quantized_gguf(d / f"{k}.gguf", weights, k) for k in ("Q4_0", "Q4_1", "Q8_0")}


@kept_quantized
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_tiny_gguf_loads_kept_quantized(tiny_q4, kind: str) -> None:
    path = tiny_q4[kind]
    quant = load_model(path, dtype="auto")
    ref = load_model(path, dtype="float32")
    assert ref.quant is None and quant.quant.method == "gguf"
    assert quant.quant.scheme.weight == mg.QUANTIZED_TYPES[kind]
    embed = quant.model.model.embed_tokens
    assert isinstance(embed, QuantEmbedding)
    assert torch.equal(
        dequantize_int_ref(embed.weight, embed.weight_scale, embed.quant_scheme),
        ref.model.model.embed_tokens.weight,
    )
    ref_modules = dict(ref.model.named_modules())
    layers = [(n, m) for n, m in quant.model.named_modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * SHAPE["layers"]
    for name, module in layers:
        w = dequantize_int_ref(module.weight, module.scale, module.quant_scheme)
        want = ref_modules[name].weight
        if module.quant_scheme.layout == "plain":  # Q8_0: exact
            assert torch.equal(w, want), name
        else:  # bfloat16 (scale, zero): within their rounding
            tol = 8 * 2**-8 * want.abs().max().item()
            assert (w - want).abs().max().item() <= tol, name
    x = torch.randn(5, SHAPE["hidden"]).bfloat16()
    module = quant.model.model.layers[0].mlp.gate_up_proj
    out = module(x)
    assert out.dtype == torch.bfloat16 and out.shape == (5, 2 * SHAPE["inter"])
    want = quant_linear_ref(x, module.weight, module.scale, None, None, module.scheme)
    assert torch.equal(out, want)


@kept_quantized
def test_gguf_types_the_quantized_path_does_not_read_are_named(tmp_path: pathlib.Path) -> None:
    weights = tiny_llama_weights(seed=3)
    path = write_quantized_gguf(tmp_path / "q5.gguf", weights, "Q5_0")
    with pytest.raises(QuantizationError, match=r"Q5_0.*--dtype float32"):
        load_model(path, dtype="auto")
    assert load_model(path, dtype="float32").quant is None  # dequantized as before
