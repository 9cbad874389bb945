"""kernels_generated/int_linear_cpu.py against the references: ATen's CPU int4 GEMM over the
int4pack_cpu layout (bfloat16 activations: within the output's bfloat16 rounding, the only
difference being the order of float32 accumulation) and the Q8_0 lm_head GEMV (float32:
within float32 rounding)."""

from __future__ import annotations

import pytest
import torch

from compile_engine.kernels_generated.int_linear_cpu import int4pack_linear, int8_group_logits
from compile_engine.models.quant import QuantScheme, pack_int4, quant_linear_ref


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4pack_linear_equals_reference(
    group: int, rows: int, bias: bool, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(group + rows)
    n, k = 192, 256
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = (torch.rand(k // group, n, 2, generator=g) * 0.05).bfloat16()
    scheme = str(QuantScheme("group", "none", weight="uint4", group=group, layout="int4pack_cpu"))
    weight = pack_int4(codes, "int4pack_cpu")
    x = torch.randn(rows, k, generator=g).to(dtype)  # float32: a float32 model's, cast inside
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    ours = int4pack_linear(x, weight, scale, None, b, scheme)
    want = quant_linear_ref(x, weight, scale, None, b, scheme)
    assert ours.dtype == dtype and ours.shape == (rows, n)
    # both accumulate in float32; the outputs differ by at most a bfloat16 rounding or two
    tol = 2 * 2**-8 * want.float().abs().amax(dim=-1, keepdim=True) + 1e-3
    assert ((ours.float() - want.float()).abs() <= tol).all()


@pytest.mark.parametrize("rows", [1, 3])
def test_int8_group_logits_equals_reference(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    n, k = 320, 96
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, k // 32, generator=g) * 0.01
    x = torch.randn(rows, k, generator=g)
    ours = int8_group_logits(x, codes, scale)
    want = quant_linear_ref(x, codes, scale, None, None, "int8:group32:none")
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)


def test_q8_logits_rows_are_the_one_row_forms_bits() -> None:
    # The quantized lm_head of 2-16 rows (speculative verification, small batches) runs the
    # rows form at a padded row count; each row comes out the one-row GEMV's bits, so greedy
    # speculation stays lossless, and more rows run the dynamic form, as close to the
    # reference. Compiled: Inductor's fusion of the rows' reductions is what is checked.
    import types

    from compile_engine.kernels_generated.int_linear_cpu import LOGIT_ROWS, Q8Logits

    g = torch.Generator().manual_seed(5)
    n, k = 320, 96
    embedding = types.SimpleNamespace(
        quant_scheme=QuantScheme.parse("int8:group32:none"),
        weight=torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g),
        weight_scale=torch.rand(n, k // 32, generator=g) * 0.01,
    )
    logits = Q8Logits(embedding)
    x = torch.randn(LOGIT_ROWS[-1] + 1, k, generator=g)
    one = torch.cat([logits(x[i : i + 1]) for i in range(x.shape[0])])
    for rows in (2, 3, 7, 16):
        assert torch.equal(logits(x[:rows]), one[:rows]), rows
    want = quant_linear_ref(
        x, embedding.weight, embedding.weight_scale, None, None, "int8:group32:none"
    )
    torch.testing.assert_close(logits(x), want, rtol=1e-5, atol=1e-5)
