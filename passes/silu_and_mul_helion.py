"""silu_and_mul -> the Helion kernel (kernels_generated/silu_and_mul_helion.py).

Matches: every `ce.silu_and_mul` node (one per decoder layer, between gate_up_proj and
down_proj). Emits: `ce_kernels.silu_and_mul_helion`, an opaque custom op around the Helion
kernel, with its config picked per shape class from configs/silu_and_mul_helion.json. Applies
on h100 in bf16 and fp16: the kernel needs compiled Helion (CUDA), and float32 on the GPU is
not a serving dtype.

Off by default (issue 5): it does not beat Inductor's own fusion of the reference, one loop
too. `bench fusions` on the H200, I = 14336 in bf16, CUDA-graph replay: x1.04 / x0.88 / x0.76 /
x0.92 over Inductor at T = 1 / 64 / 256 / 2048 with the configs tuned on the H200 (Helion's
quick autotune found none faster than the default there), x0.99 / x0.73 / x1.01 / x1.23 in a
first run with earlier configs. `--passes +silu_and_mul_helion` selects it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import fx

from compile_engine import kernels_generated
from compile_engine.passes.base import GraphPass, PassContext, lower, op_nodes
from compile_engine.passes.registry import register


@register
class SiluAndMulHelion(GraphPass):
    name = "silu_and_mul_helion"
    description = "silu_and_mul -> Helion kernel, per-shape tuned configs (off: ties Inductor)"
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
        import compile_engine.kernels_generated.silu_and_mul_helion  # noqa: F401  (registers ce_kernels ops)

        kernel = torch.ops.ce_kernels.silu_and_mul_helion.default
        nodes = op_nodes(graph, "silu_and_mul")
        for node in nodes:
            lower(node, kernel, ctx)
        return len(nodes)
