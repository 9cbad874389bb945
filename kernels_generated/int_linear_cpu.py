"""Integer weight-only linears on the CPU (issue 29): what the quantized GEMM pass lowers a
4-bit `ce.quant_linear` to, and the quantized lm_head's GEMV.

- `int4pack_linear`: ATen's CPU int4 GEMM, `aten._weight_int4pack_mm_for_cpu(x, w, group,
  scale_zeros)`, over the "int4pack_cpu" layout (models/quant.py says it: rows in blocks of
  64, (scale, zero) [G, N, 2] in the activation's dtype, w = (q - 8) * scale + zero). It
  dequantizes in registers and accumulates in float32; x must be bfloat16 (float32 takes a
  scalar path 30x slower, measured below). Same signature as `quant_linear_ref`, which is its
  oracle (tests/kernels/test_int_linear_cpu.py: within bfloat16 rounding of the output).
- `int8_group_logits`: y[t, n] = sum_k x[t, k] * q[n, k] * s[n, k // g] over an int8 weight
  with per-group scales (a GGUF Q8_0 token_embd, which is also SmolLM2's tied lm_head), written
  so that Inductor's C++ codegen fuses the dequantization into the reduction: one pass over
  the int8 codes, no [V, H] float weight. The output is computed as [N, T] so that a weight
  row is reused from L1 across the T rows. It runs outside the compiled graph (the lm_head
  does), so `Q8Logits` compiles it once per shape class (1 row, and 2+ rows dynamic).

Measured on the 2-core Xeon (one thread, loaded machine, min of alternating rounds, us), one
SmolLM2 layer's four linears at 1 / 16 rows: fp32 F.linear 587 / 1,662, bf16 734 / 696, int4
(bf16 x) 206 / 1,407, int4 (fp32 x) 6,074 / 127,357, int8 per-channel `_weight_int8pack_mm`
253 / 1,662. The lm_head ([49152, 576]) at 1 / 16 rows: bf16 F.linear 10,638 / 12,101, this
fused Q8_0 GEMV ~5,000-9,700 / 42,133, `_weight_int8pack_mm` per channel (inexact for Q8_0)
4,968 / 27,085, 18 per-group `_weight_int8pack_mm` calls 11,697 / 78,547, eager chunked
dequantize + bf16 matmul 42,399 / 39,841 (docs/compiler.md, section 8).
"""

from __future__ import annotations

import torch
from torch import Tensor

from compile_engine.models.quant import QuantScheme


def int4pack_linear(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    input_scale: Tensor | None,
    bias: Tensor | None,
    scheme: str,
) -> Tensor:
    """quant_linear over a 4-bit weight in the int4pack_cpu layout. x [T, K], computed in
    the scales' dtype (bfloat16) and returned in x's."""
    group = QuantScheme.parse(scheme).group
    xq = x.to(weight_scale.dtype)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(xq, weight, group, weight_scale)  # [T, N]
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out


def int8_group_logits(x: Tensor, codes: Tensor, scale: Tensor) -> Tensor:
    """x [T, K]; codes int8 [N, K]; scale float32 [N, G] -> [T, N] in x's dtype, accumulated
    in float32 (the dequantized weight is the reference's, bit for bit)."""
    n, k = codes.shape
    groups = scale.shape[1]
    w = codes.view(n, groups, k // groups).float() * scale.view(n, groups, 1)  # [N, G, g]
    out = (w.view(n, 1, k) * x.float()[None, :, :]).sum(-1)  # [N, T]
    return out.t().to(x.dtype)


def int8_group_logits_rows(x: Tensor, codes: Tensor, scale: Tensor) -> Tensor:
    """`int8_group_logits` for a few rows, one reduction a row: compiled at a fixed row count,
    Inductor fuses the rows' reductions into one loop that dequantizes each weight element
    once for all of them (the [N, T] form dequantizes it once a row), and each row's sum is
    the one-row form's, bit for bit (tests/kernels/test_int_linear_cpu.py)."""
    n, k = codes.shape
    groups = scale.shape[1]
    w = (codes.view(n, groups, k // groups).float() * scale.view(n, groups, 1)).view(n, k)
    xf = x.float()
    return torch.stack([(w * xf[t]).sum(-1) for t in range(x.shape[0])]).to(x.dtype)


# The row counts `Q8Logits` compiles `int8_group_logits_rows` at (a step's rows padded up to
# the next): speculative verification (1 + k rows a sequence) and small decode batches. SmolLM2's
# [49152, 576] Q8_0 head on the 2-core Xeon (one process, min of 7, on 9c333c7): 4 / 8 / 16 rows
# 2.29 / 3.54 / 6.57 ms against 4.61 / 8.32 / 16.20 in the dynamic [N, T] form (one row 1.15).
LOGIT_ROWS = (2, 4, 8, 16)


class Q8Logits:
    """The compiled `int8_group_logits` of one QuantEmbedding (a tied, quantized lm_head): one
    row, 2-16 rows padded to a `LOGIT_ROWS` count, and more rows in one dynamic form."""

    def __init__(self, embedding: torch.nn.Module) -> None:
        scheme = embedding.quant_scheme
        if scheme.weight != "int8" or scheme.layout != "plain":
            raise ValueError(f"Q8Logits runs int8 group weights, not {scheme}")
        self.embedding = embedding
        self._one = torch.compile(int8_group_logits, dynamic=False, fullgraph=True)
        self._rows = torch.compile(int8_group_logits_rows, dynamic=False, fullgraph=True)
        self._many = torch.compile(int8_group_logits, dynamic=True, fullgraph=True)

    def __call__(self, hidden: Tensor) -> Tensor:
        rows = hidden.shape[0]
        args = (self.embedding.weight, self.embedding.weight_scale)
        if rows == 1:
            return self._one(hidden, *args)
        if rows > LOGIT_ROWS[-1]:
            return self._many(hidden, *args)
        padded = next(r for r in LOGIT_ROWS if r >= rows)
        if padded != rows:
            hidden = torch.cat([hidden, hidden.new_zeros(padded - rows, hidden.shape[1])])
        return self._rows(hidden, *args)[:rows]

    def warm(self, hidden_size: int, dtype: torch.dtype) -> None:
        """Compile every shape class now, so that no request pays for it."""
        for rows in (1, *LOGIT_ROWS, LOGIT_ROWS[-1] + 1):
            self(torch.zeros(rows, hidden_size, dtype=dtype))
