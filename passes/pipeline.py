"""The pass pipeline: every registered pass, in the order the pass manager applies them.

A pass that rewrites a chain of ops comes before the passes that would each take one op of
that chain, since whichever pass runs first claims the nodes. This list is the only place the
order is written: the registry checks at load that it names every registered pass once, and
`select` returns the chosen passes in this order whatever their files are called.
tests/passes/test_pipeline.py checks that the constraints these reasons name hold.

The pass manager's uuid hashes the names in this order, so an artifact built before a reorder
is rebuilt, not reused.
"""

from __future__ import annotations

# (pass name, why it sits here), first applied first.
PIPELINE: tuple[tuple[str, str], ...] = (
    (
        "all_reduce_norm",
        "a chain ending in add_rms_norm, so before add_rms_norm_into_gemm and rms_norm_triton, "
        "which would take the norm",
    ),
    (
        "add_rms_norm_into_gemm",
        "a chain of three ops, so before rms_norm_triton, skinny_gemm and the silu_and_mul "
        "passes, which each take one of them",
    ),
    (
        "rotary_into_attention",
        "a pair of ops, so before rotary_triton and paged_attention_triton, which each take "
        "one of them",
    ),
    ("mla_absorb", "matches mla_attention, which no other pass matches"),
    (
        "moe_grouped_gemm",
        "the MoE chain, so before the silu_and_mul passes, which would take its silu_and_mul",
    ),
    (
        "quantized_gemm",
        "quant_linear, which no other pass matches; before the silu_and_mul passes, since it "
        "lowers a silu_and_mul feeding an FP8 linear to its reference (Inductor fuses the "
        "activation's quantization into it), and before lower_to_reference, which lowers the "
        "quantize_fp8 nodes it adds",
    ),
    ("paged_attention_triton", "the attention nodes that rotary_into_attention left"),
    ("paged_attention_cpu", "the attention nodes on cpu (no other cpu pass matches them)"),
    ("rms_norm_triton", "the norms that add_rms_norm_into_gemm left"),
    ("rotary_triton", "the rotary nodes that rotary_into_attention left"),
    (
        "silu_and_mul_helion",
        "before silu_and_mul_triton, so that with both selected the Helion kernel wins",
    ),
    ("silu_and_mul_triton", "the silu_and_mul nodes that no earlier pass claimed"),
    ("skinny_gemm", "the bias-free linears that add_rms_norm_into_gemm left"),
    (
        "lower_to_reference",
        "last: what no kernel pass claimed reaches Inductor as its reference to fuse, not as "
        "an opaque call",
    ),
)

ORDER: tuple[str, ...] = tuple(name for name, _ in PIPELINE)
