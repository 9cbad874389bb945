"""silu_and_mul -> the Helion kernel (kernels_generated/silu_and_mul_helion.py).

Matches: every `ce.silu_and_mul` node (one per decoder layer, between gate_up_proj and
down_proj). Emits: `ce_kernels.silu_and_mul_helion`, an opaque custom op around the Helion
kernel, with its config picked per shape class from configs/silu_and_mul_helion.json. Applies
on h100 in bf16 and fp16: the kernel needs compiled Helion (CUDA), and float32 on the GPU is
not a serving dtype.

Off by default (issue 5): Inductor already fuses the reference's silu and mul into one loop,
and the opaque op stops it from also fusing into the neighbouring matmul's epilogue or the
next op's prologue. It turns on by default only if the H200 latency benchmark shows it beating
Inductor's own fusion; until then `--passes +silu_and_mul_helion` selects it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import fx

import kernels_generated
from passes.base import GraphPass, PassContext, op_nodes
from passes.registry import register


@register
class SiluAndMulHelion(GraphPass):
    name = "silu_and_mul_helion"
    description = "silu_and_mul -> Helion kernel with per-shape tuned configs (off: unmeasured)"
    targets = ("h100",)
    dtypes = (torch.bfloat16, torch.float16)
    default_on = False

    def uuid(self) -> str:
        # The kernel and its tuned configs are what the rewritten graph calls, so a change in
        # either must change the artifact's cache key, not only a change in this class.
        h = hashlib.sha256(super().uuid().encode())
        root = Path(kernels_generated.__file__).parent
        for path in (root / "silu_and_mul_helion.py", root / "configs/silu_and_mul_helion.json"):
            h.update(path.read_bytes())
        return h.hexdigest()[:16]

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        # Imported here, not at module import: listing passes must not need helion installed.
        import kernels_generated.silu_and_mul_helion  # noqa: F401  (registers ce_kernels ops)

        kernel = torch.ops.ce_kernels.silu_and_mul_helion.default
        nodes = op_nodes(graph, "silu_and_mul")
        for node in nodes:
            node.target = kernel
        return len(nodes)
