"""quant_linear (FP8 weights) -> the FP8 GEMMs on h100; -> its reference on cpu.

Matches: every `ce.quant_linear` node (a QuantLinear of an FP8 checkpoint or of
`quantization="fp8"`, models/quant.py: qkv_proj, o_proj, gate_up_proj and down_proj of each
layer of a Llama-family model). Emits, on h100 in bf16/fp16: `ce_kernels.fp8_linear(x, weight,
weight_scale, input_scale, bias, scheme)` (kernels_generated/fp8_linear.py), which per call
runs, up to 16 rows, the skinny Triton GEMM over e4m3 weight tiles with the activation in the
model dtype (the step is weight-bound: FP8 halves its bytes) and the scale in the epilogue
(per K-tile for block scales), with the launch config tuned per (N, K, rows) in
configs/fp8_gemm.json; above 16 rows it quantizes the activation as the scheme says (one Triton
launch per token row, or the static scale) and multiplies with `torch._scaled_mm` (tensor-wise
or row-wise scales), or, for block scales and W8A16, the same Triton kernel with tensor-core
tiles. On cpu: the reference (`quant_linear_ref`: dequantize, matmul in float32), which
Inductor traces and fuses like any other, so a CPU build runs FP8 checkpoints exactly as the
oracle does.

Not done here (issue 28's later parts): the per-token quantization fused into the preceding
add+rms_norm / silu_and_mul kernels (above 16 rows it is one launch of its own per linear);
FP8 experts in the MoE grouped GEMM (quantize_model refuses MoE models).
"""

from __future__ import annotations

import torch
from torch import fx

from compile_engine.models.quant import quant_linear_ref
from compile_engine.passes.base import GraphPass, PassContext, lower, op_nodes
from compile_engine.passes.registry import register

H100_DTYPES = (torch.bfloat16, torch.float16)


@register
class QuantizedGemm(GraphPass):
    name = "quantized_gemm"
    description = (
        "quant_linear -> FP8 skinny GEMM (<= 16 rows) / _scaled_mm (h100), reference (cpu)"
    )
    targets = ("cpu", "h100")
    kernel_files = (
        "kernels_generated/fp8_linear.py",
        "kernels_generated/skinny_gemm.py",
        "kernels_generated/configs/fp8_gemm.json",
    )

    def applies(self, ctx: PassContext) -> bool:
        # h100: the GEMMs write half precision (row-wise _scaled_mm); cpu: any dtype.
        return ctx.target == "cpu" or (ctx.target == "h100" and ctx.dtype in H100_DTYPES)

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        nodes = op_nodes(graph, "quant_linear")
        if ctx.target == "cpu":
            for node in nodes:
                node.target = quant_linear_ref
            return len(nodes)
        import compile_engine.kernels_generated.fp8_linear  # noqa: F401  (registers the op)

        kernel = torch.ops.ce_kernels.fp8_linear.default
        for node in nodes:
            lower(node, kernel, ctx)
        return len(nodes)
