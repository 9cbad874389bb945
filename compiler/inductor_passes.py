"""Passes we hand to Inductor itself (post-grad, aten level), as opposed to passes/ (our ops,
before AOT tracing). Only what has to see Inductor's own rewrites lives here.

`UnfuseResidualAddmm`: Inductor's post-grad pattern `addmm` (torch/_inductor/fx_passes/
post_grad.py) turns `mm(x, W) + residual` into `aten.addmm(residual, x, W)` whenever the sum
has a non-pointwise user: a piece output (the residual stream handed to the next piece) or
another addmm. aten's addmm with a 2-D `self` that is not its `out` first copies `self` into
`out` (cudaMemcpyAsync DtoD; on CPU an aten::copy_) and then runs the GEMM with beta = 1,
which reads `out` back. In the Llama forward that is both residual adds of every repeated
middle piece: 2 x 31 copies of [T, 4096] per Llama-3-8B step on the H200 (8.6 us each at
2,048 tokens), plus the GEMM's read of C. Left as `mm` then `add`, the add fuses into the
rms_norm kernel that reads the sum anyway: no copy, no extra launch, less traffic.

Numerics: the sum is rounded as the model wrote it (the projection rounded to the activation
dtype, then the add), which is what eager PyTorch and HF compute; the fused addmm added the
residual to the fp32 accumulator instead (bit-identical in float32 up to the GEMM's own
summation order, up to one bf16 ulp apart in bf16).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten


class UnfuseResidualAddmm(CustomGraphPass):
    """addmm(c, a, b) with a full [M, N] `c` and alpha = beta = 1 -> mm(a, b) + c.

    A 1-D (or broadcast) `c` is a bias: aten adds it in cuBLASLt's epilogue without a copy,
    so those addmm nodes are left alone."""

    def __init__(self) -> None:
        self.rewritten = 0  # over the life of the process, for tests and logs

    def __call__(self, graph: fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not aten.addmm.default:
                continue
            if node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("beta", 1) != 1:
                continue
            inp, mat1, mat2 = node.args[:3]
            if not all(isinstance(n, fx.Node) and "val" in n.meta for n in (inp, mat1, mat2)):
                continue
            c, a, b = inp.meta["val"], mat1.meta["val"], mat2.meta["val"]
            if not _is_full_matrix(c, (a.shape[0], b.shape[1])):
                continue
            with graph.inserting_before(node):
                mm = graph.call_function(aten.mm.default, (mat1, mat2))
                add = graph.call_function(aten.add.Tensor, (mm, inp))
            # Later lowering reads the fake values of every node.
            mm.meta.update(node.meta)
            add.meta.update(node.meta)
            mm.meta["val"] = aten.mm.default(a, b)
            add.meta["val"] = aten.add.Tensor(mm.meta["val"], c)
            node.replace_all_uses_with(add)
            graph.erase_node(node)
            self.rewritten += 1

    def uuid(self) -> str:
        # Inductor's FX graph cache keys on this: a change to this file recompiles the pieces.
        return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def _is_full_matrix(c: torch.Tensor, shape: tuple) -> bool:
    """c is [M, N] itself, not a row or column broadcast to it (sizes symbolic in T)."""
    if c.dim() != 2:
        return False
    for size, want, stride in zip(c.shape, shape, c.stride(), strict=True):
        if not statically_known_true(size == want) or statically_known_true(stride == 0):
            return False
    return True


UNFUSE_RESIDUAL_ADDMM = UnfuseResidualAddmm()
