"""The vnni_cpu kernel (kernels_generated/vnni_linear_cpu.py) against its reference
(`quant_linear_ref`: the weight dequantized as the file's formula says, the activation quantized
to 16 bits per group of 32 and back, a float32 matmul): equal but for the order floats are added,
at every row count and for each GGUF format it holds; and the layout round-trips."""

from __future__ import annotations

import pytest
import torch

from compile_engine.models.quant import (
    INT16_GROUP_LEVELS,
    QuantScheme,
    dequantize_int_ref,
    pack_int4,
    pack_vnni,
    quant_linear_ref,
    quantize_int16_groups_ref,
    unpack_vnni,
    vnni_cpu_isas,
    vnni_scales,
)

ISAS = vnni_cpu_isas()
# Each build the machine runs (an AVX-512 machine runs both); none: skipped, with the reason.
each_isa = pytest.mark.parametrize(
    "isa",
    ISAS or [pytest.param(None, marks=pytest.mark.skip(reason="needs AVX-512 VNNI or AVX2, g++"))],
)


def kernel(isa: str):
    from compile_engine.kernels_generated.vnni_linear_cpu import load, vnni_linear

    op = load(isa)

    def run(x, packed, scales, scheme):
        if isa == ISAS[0]:  # the machine's own: through the lowering the pass uses
            return vnni_linear(x, packed, scales, None, None, str(scheme))
        return op(x.float().contiguous(), packed, scales, scheme.bits)

    return run


def random_weight(weight: str, n: int, k: int, seed: int):
    """Codes as a checkpoint hands them (int8 for int8) and float32 scales, plain layout."""
    g = torch.Generator().manual_seed(seed)
    groups = k // 32
    if weight == "int8":
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int16).to(torch.int8)
    else:
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    s = torch.rand(n, groups, generator=g) * 0.02 + 1e-3
    if weight == "uint4":
        return codes, torch.stack([s, -torch.rand(n, groups, generator=g) * 0.1], dim=-1)
    return codes, s


def to_vnni(weight: str, codes, scale):
    """What QuantLinear's loader stores for the vnni_cpu layout."""
    scheme = QuantScheme("group", "int16_group", weight=weight, group=32, layout="vnni_cpu")
    offset = 128 if weight == "int8" else 0
    u = (codes.to(torch.int16) + offset).to(torch.uint8)
    bits = 8 if weight == "int8" else 4
    return scheme, pack_vnni(u, bits), vnni_scales(scale, scheme)


@pytest.mark.parametrize("weight", ["int4", "uint4", "int8"])
def test_the_layout_dequantizes_to_the_plain_layouts_weight_bit_for_bit(weight: str) -> None:
    codes, scale = random_weight(weight, 48, 128, seed=1)
    plain = QuantScheme("group", "none", weight=weight, group=32)
    stored = pack_int4(codes, "plain") if weight != "int8" else codes
    expected = dequantize_int_ref(stored, scale, plain)
    scheme, packed, scales = to_vnni(weight, codes, scale)
    assert torch.equal(dequantize_int_ref(packed, scales, scheme), expected)
    bits = 8 if weight == "int8" else 4
    offset = 128 if weight == "int8" else 0
    assert torch.equal(unpack_vnni(packed, bits).to(torch.int16) - offset, codes.to(torch.int16))


def test_a_groups_amax_takes_the_top_code_and_a_zero_group_zeros() -> None:
    x = torch.tensor([[1.0] + [0.0] * 31])
    q, d = quantize_int16_groups_ref(x, 32)
    assert q[0, 0] == INT16_GROUP_LEVELS and d[0, 0] == 1.0 / INT16_GROUP_LEVELS
    zero = quantize_int16_groups_ref(torch.zeros(1, 32), 32)
    assert torch.equal(zero[0], torch.zeros(1, 32, dtype=torch.int16)) and zero[1].item() == 0


@each_isa
@pytest.mark.parametrize("weight", ["int4", "uint4", "int8"])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 16, 40])
def test_kernel_equals_its_reference(isa: str, weight: str, rows: int) -> None:
    n, k = 96, 192
    codes, scale = random_weight(weight, n, k, seed=rows)
    scheme, packed, scales = to_vnni(weight, codes, scale)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7)) * 3
    x[0, :32] = 0  # an all-zero group
    got = kernel(isa)(x, packed, scales, scheme)
    want = quant_linear_ref(x, packed, scales, None, None, str(scheme))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # and close to the float32 product itself (16-bit activations)
    exact = x @ dequantize_int_ref(packed, scales, scheme).t()
    torch.testing.assert_close(got, exact, rtol=1e-3, atol=1e-3 * exact.abs().max().item())


@each_isa
def test_a_rows_result_does_not_depend_on_the_other_rows(isa: str) -> None:
    codes, scale = random_weight("uint4", 64, 128, seed=3)
    scheme, packed, scales = to_vnni("uint4", codes, scale)
    x = torch.randn(17, 128, generator=torch.Generator().manual_seed(2))
    run = kernel(isa)
    many = run(x, packed, scales, scheme)
    for t in (0, 4, 8, 16):
        one = run(x[t : t + 1], packed, scales, scheme)
        assert torch.equal(one[0], many[t])


@pytest.mark.skipif(len(ISAS) < 2, reason="needs a CPU with AVX-512 VNNI (it runs both builds)")
@pytest.mark.parametrize("weight", ["uint4", "int8"])
def test_the_avx2_build_equals_the_avx512_build_bit_for_bit(weight: str) -> None:
    codes, scale = random_weight(weight, 64, 256, seed=5)
    scheme, packed, scales = to_vnni(weight, codes, scale)
    x = torch.randn(11, 256, generator=torch.Generator().manual_seed(4)) * 5
    x[3, 64:96] = 0
    got = [kernel(isa)(x, packed, scales, scheme) for isa in ISAS]
    assert torch.equal(got[0], got[1])


@pytest.mark.skipif(not ISAS, reason="needs AVX-512 VNNI or AVX2, g++")
def test_the_lm_head_packs_the_codes_it_is_warmed_with_not_those_it_was_built_over() -> None:
    """The engine builds the tied Q8_0 head before the weight read fills the embedding and warms
    it after (compiler/compiled_model.py); packed at construction, a second engine in a process
    answered garbage. The head then equals the reference over the codes read."""
    from compile_engine.kernels_generated.vnni_linear_cpu import VnniLogits
    from compile_engine.models.quant import QuantEmbedding

    vocab, hidden = 64, 96
    scheme = QuantScheme("group", "none", weight="int8", group=32)
    embedding = QuantEmbedding(vocab, hidden, scheme, torch.float32)
    with torch.no_grad():
        embedding.weight.zero_()
        embedding.weight_scale.zero_()
    head = VnniLogits(embedding)
    codes, scale = random_weight("int8", vocab, hidden, seed=5)
    with torch.no_grad():
        embedding.weight.copy_(codes)
        embedding.weight_scale.copy_(scale)
    head.warm(hidden, torch.float32)
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(1))
    want = embedding.logits(x)
    assert want.abs().max() > 0
    torch.testing.assert_close(head(x), want, rtol=1e-3, atol=1e-3 * want.abs().max().item())
