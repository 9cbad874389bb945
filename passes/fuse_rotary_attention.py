"""rotary + paged_attention -> one Triton launch that rotates q and k as it loads them.

Matches: a `ce.paged_attention` whose q and k are the two outputs of one `ce.rotary` and
nothing else's (one pair per attention layer: QKV projection -> rotary -> attention). Emits:
`ce_kernels.paged_attention_rotary` (kernels_generated/paged_attention/) on the unrotated q
and k, the rotary's positions and cos/sin table: the kernel applies the rotation where it
loads q, the token's own key and this step's keys, and writes the rotated keys to the cache,
so the layer loses the rotary kernel and its rotated copies of q and k. The rotation rounds
as `ce.rotary`'s reference does (each product and the sum in the activation dtype), so the
cache holds the same keys bit for bit. Applies on h100; registered before
paged_attention_triton and rotary_triton, which take whatever it leaves.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from compile_engine.passes.base import GraphPass, PassContext, op_nodes
from compile_engine.passes.registry import register


def _rotary_pair(attention: fx.Node) -> fx.Node | None:
    """The ce.rotary node whose outputs 0 and 1 are the attention's q and k and feed nothing
    else, or None."""
    if attention.kwargs or len(attention.args) not in (9, 11):  # without / with the KV scales
        return None
    q, k = attention.args[0], attention.args[1]
    for node, index in ((q, 0), (k, 1)):
        if not (
            isinstance(node, fx.Node)
            and node.op == "call_function"
            and node.target is operator.getitem
            and node.args[1] == index
            and len(node.users) == 1
        ):
            return None
    rotary = q.args[0]
    if (
        rotary is not k.args[0]
        or not isinstance(rotary, fx.Node)
        or rotary.target is not torch.ops.ce.rotary.default
        or rotary.kwargs
        or set(rotary.users) != {q, k}
    ):
        return None
    return rotary


@register
class RotaryIntoAttention(GraphPass):
    name = "rotary_into_attention"
    description = "rotary + paged_attention -> one Triton kernel rotating q and k as it loads"
    targets = ("h100",)
    kernel_files = (
        "kernels_generated/paged_attention/__init__.py",
        "kernels_generated/paged_attention/kernels.py",
        "kernels_generated/paged_attention/launch.py",
        "kernels_generated/paged_attention/ops.py",
    )

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        import compile_engine.kernels_generated.paged_attention  # noqa: F401  (registers ce_kernels ops)

        fused = torch.ops.ce_kernels.paged_attention_rotary.default
        count = 0
        for attention in op_nodes(graph, "paged_attention"):
            rotary = _rotary_pair(attention)
            if rotary is None:
                continue
            positions, q, k, cos_sin_cache = rotary.args
            rest = (*attention.args[2:], None, None)[:9]  # v .. scale, k_scale, v_scale
            with graph.inserting_before(attention):
                node = graph.call_function(
                    fused, (q, k, *rest, positions, cos_sin_cache, ctx.kernel.key)
                )
            node.meta.update(attention.meta)
            attention.replace_all_uses_with(node)
            graph.erase_node(attention)
            count += 1
        # The rotary nodes and their getitems are dead now; the pass manager's DCE drops them.
        return count
