"""quant_linear (FP8 weights) -> the activation's quantization + the FP8 GEMMs on h100; -> its
reference on cpu.

Matches: every `ce.quant_linear` node (a QuantLinear of an FP8 checkpoint or of
`quantization="fp8"`, models/quant.py: qkv_proj, o_proj, gate_up_proj and down_proj of each
layer of a Llama-family model). Emits, on h100 in bf16/fp16:

- where the scheme quantizes the activation (dynamic per token, static per tensor): a
  `ce.quantize_fp8(x, input_scale)` node, which lower_to_reference turns into its reference
  for Inductor, so the row's amax and the e4m3 cast fuse into the kernel that makes x (the
  add + rms_norm before qkv_proj and gate_up_proj; silu_and_mul before down_proj, which this
  pass lowers to its reference for that, so it must run before the silu_and_mul passes; a
  kernel of its own only after attention, before o_proj);
- `ce_kernels.fp8_linear(x_q, x_scale, weight, weight_scale, bias, scheme, dtype)`
  (kernels_generated/fp8_linear.py): per call, up to 16 rows the skinny Triton GEMM on FP8
  tensor cores streaming the e4m3 weight, the scales in its epilogue, its launch config tuned
  per (N, K, rows) in configs/fp8_gemm.json; above 16 rows `torch._scaled_mm` (tensor-wise or
  row-wise scales), or for block scales and W8A16 the same Triton kernel on tensor-core tiles.

On h100, integer weight-only schemes (GPTQ / AWQ / compressed-tensors int4 and int8, issue 29):
`ce_kernels.int_linear(x, weight, weight_scale, bias, scheme, tuning_key)`
(kernels_generated/int_linear.py), one Triton kernel dequantizing in registers at every row
count (fma / skinny / tensor-core tiles, configs/int_gemm.json); the GGUF (s, m) formats (uint4,
uint8), which the loader only keeps quantized on the CPU, fall back to the reference.

On cpu: weights in the vnni_cpu layout (a GGUF file's Q4_0 / Q4_1 / Q8_0 projections, kept quantized
where the CPU has AVX-512 VNNI or AVX2: models/loader.py) -> `vnni_linear`
(kernels_generated/vnni_linear_cpu.py: our C++ kernel, 16-bit activations times the 4- or 8-bit
codes in int32); 4-bit weights in the int4pack_cpu layout (the same files on a CPU with bfloat16
that runs neither build of our kernel: an Arm one) -> `int4pack_linear`
(kernels_generated/int_linear_cpu.py: ATen's int4 GEMM, dequantizing in registers); anything else ->
the reference (`quant_linear_ref`:
dequantize, matmul in float32), which Inductor traces and fuses like any other, so a CPU build
runs FP8 and int8 checkpoints exactly as the oracle does.

Not done (issue 28's later parts): the activation's quantization fused into our own Triton
kernels (the add_rms_norm_into_gemm fusion of the bf16 path has no FP8 form yet, so an FP8
layer runs 9 kernels at batch 1 where bf16 runs 5); FP8 experts in the MoE grouped GEMM
(quantize_model refuses MoE models).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from compile_engine.kernels_generated import vnni_linear_cpu
from compile_engine.kernels_generated.int_linear_cpu import int4pack_linear
from compile_engine.models.ops import silu_and_mul_ref
from compile_engine.models.quant import QuantScheme, quant_linear_ref
from compile_engine.passes.base import GraphPass, PassContext, op_nodes
from compile_engine.passes.registry import register

H100_DTYPES = (torch.bfloat16, torch.float16)


@register
class QuantizedGemm(GraphPass):
    name = "quantized_gemm"
    description = (
        "quant_linear -> fused act. quant + FP8 skinny GEMM / _scaled_mm, int4/int8 "
        "dequantizing Triton GEMM (h100); VNNI integer GEMM, ATen int4 GEMM, else ref (cpu)"
    )
    targets = ("cpu", "h100")
    kernel_files = (
        "kernels_generated/fp8_linear.py",
        "kernels_generated/skinny_gemm.py",
        "kernels_generated/counters.py",
        "kernels_generated/configs/fp8_gemm.json",
        "kernels_generated/int_linear_cpu.py",
        "kernels_generated/vnni_linear_cpu.py",
        "kernels_generated/csrc/vnni_linear.cpp",
        "kernels_generated/int_linear.py",
        "kernels_generated/configs/int_gemm.json",
    )

    def applies(self, ctx: PassContext) -> bool:
        # h100: the GEMMs write half precision (row-wise _scaled_mm); cpu: any dtype.
        return ctx.target == "cpu" or (ctx.target == "h100" and ctx.dtype in H100_DTYPES)

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        nodes = op_nodes(graph, "quant_linear")
        if ctx.target == "cpu":
            lowering = {"vnni_cpu": vnni_linear_cpu.vnni_linear, "int4pack_cpu": int4pack_linear}
            for node in nodes:
                # Our VNNI kernel, ATen's int4 GEMM, by the weight's layout; else the reference.
                layout = QuantScheme.parse(node.args[5]).layout
                if layout == "vnni_cpu":
                    vnni_linear_cpu.load()  # registers the op the traced graph calls
                node.target = lowering.get(layout, quant_linear_ref)
            return len(nodes)
        import compile_engine.kernels_generated.fp8_linear  # noqa: F401  (registers the op)
        from compile_engine.kernels_generated.int_linear import KERNEL_WEIGHTS  # registers the op

        kernel = torch.ops.ce_kernels.fp8_linear.default
        quantize = torch.ops.ce.quantize_fp8.default
        silu = torch.ops.ce.silu_and_mul.default
        for node in nodes:
            x, weight, weight_scale, input_scale, bias, scheme = node.args
            parsed = QuantScheme.parse(scheme)
            if parsed.is_int:
                if parsed.weight not in KERNEL_WEIGHTS or parsed.layout != "plain":
                    node.target = quant_linear_ref  # GGUF's (s, m) formats: no GPU kernel
                    continue
                with graph.inserting_before(node):
                    args = (x, weight, weight_scale, bias, scheme, ctx.kernel.key)
                    new = graph.call_function(torch.ops.ce_kernels.int_linear.default, args)
                new.meta.update(node.meta)
                node.replace_all_uses_with(new)
                graph.erase_node(node)
                continue
            activation = parsed.activation
            with graph.inserting_before(node):
                if activation == "none":
                    x_q, x_scale = x, None
                else:
                    if isinstance(x, fx.Node) and x.target is silu and len(x.users) == 1:
                        x.target = silu_and_mul_ref  # Inductor fuses the quantization into it
                    static = input_scale if activation == "tensor" else None
                    quantized = graph.call_function(quantize, (x, static))
                    x_q = graph.call_function(operator.getitem, (quantized, 0))
                    x_scale = graph.call_function(operator.getitem, (quantized, 1))
                args = (x_q, x_scale, weight, weight_scale, bias, scheme, ctx.dtype, ctx.kernel.key)
                fp8 = graph.call_function(kernel, args)
            fp8.meta.update(node.meta)
            node.replace_all_uses_with(fp8)
            graph.erase_node(node)
        return len(nodes)
