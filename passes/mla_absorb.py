"""MLA: the naive up-projected attention -> the weight-absorbed latent form.

Matches: every `ce.mla_attention` (one per DeepSeek layer: gather the cached latents,
up-project them with kv_b_proj into K and V for every head, masked SDPA). Emits, in place of
the node (R = kv_lora_rank, P = qk_rope_head_dim, N = qk_nope_head_dim, V = v_head_dim):

    W_UK, W_UV = kv_b_proj.weight.view(H, N + V, R) split at N   # views, no copy
    q_latent   = cat(einsum("thn,hnr->thr", q_nope, W_UK), q_pe)   # [T, H, R + P]
    o_latent   = mla_latent_attention(q_latent, latent, cache, ...) # [T, H, R], the split point
    out        = einsum("thr,hvr->thv", o_latent, W_UV)             # [T, H, V]

The two einsums are plain torch ops: they land in the compiled pieces on either side of the
attention op, where Inductor turns them into batched GEMMs. The attention op reads each
cached row [R + P] once for all H heads (one shared latent "KV head") instead of
up-projecting the whole context every step: per decode token and layer the naive form costs
L (R H (N + V)) multiply-adds to rebuild K and V, the absorbed one H (N R + R V) once.

On h100 the attention op is `ce_kernels.mla_latent_attention`, the Triton kernel of
kernels_generated/mla_attention/ (one launch per layer for the whole packed batch, no host
sync, CUDA-graph safe), with the kernel config's key as its last argument. On cpu it is
`ce.mla_latent_attention`, the plain-PyTorch reference of the same latent form (still no
up-projection of the context).

Prefill chunks take the absorbed path too, in the same launch as the decodes of the step. For
long prefills the up-projected form does fewer FLOPs per (query, key) pair (H (N + P + V) vs
H (2 R + P), 3.4x less at DeepSeek-V2 sizes), but choosing per sequence would split the
packed batch on values known only on the device; docs/mla.md records the trade.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import fx

from compile_engine.models import mla
from compile_engine.passes.base import REPO_ROOT, GraphPass, PassContext, op_nodes
from compile_engine.passes.registry import register


def _val(node: fx.Node) -> torch.Tensor:
    return node.meta["example_value"]


def _emit(graph: fx.Graph, target, args: tuple) -> fx.Node:
    # No example value: the pieces are re-traced from their inputs when they are compiled.
    return graph.call_function(target, args)


def absorb(graph: fx.Graph, node: fx.Node, latent_attention, extra: tuple = ()) -> fx.Node:
    """Replace one mla_attention node by the absorbed composition; returns its output node.
    `extra`: arguments the latent op takes after the reference's (a kernel op's config key)."""
    q, kv_latent, cache, slots, tables, seq_lens, starts, w_kv_b, scale = node.args
    rank, rope, nope, v_dim = mla.mla_dims(_val(q), _val(cache), _val(w_kv_b))
    num_heads = _val(q).shape[1]
    with graph.inserting_before(node):
        w = _emit(graph, torch.Tensor.view, (w_kv_b, num_heads, nope + v_dim, rank))
        w_uk = _emit(graph, torch.narrow, (w, 1, 0, nope))  # [H, N, R]
        w_uv = _emit(graph, torch.narrow, (w, 1, nope, v_dim))  # [H, V, R]
        q_nope = _emit(graph, torch.narrow, (q, -1, 0, nope))  # [T, H, N]
        q_pe = _emit(graph, torch.narrow, (q, -1, nope, rope))  # [T, H, P]
        q_absorbed = _emit(graph, torch.einsum, ("thn,hnr->thr", q_nope, w_uk))
        q_latent = _emit(graph, torch.cat, ([q_absorbed, q_pe], -1))  # [T, H, R+P]
        o_latent = _emit(
            graph,
            latent_attention,
            (q_latent, kv_latent, cache, slots, tables, seq_lens, starts, rank, scale, *extra),
        )  # [T, H, R]
        out = _emit(graph, torch.einsum, ("thr,hvr->thv", o_latent, w_uv))
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    return out


@register
class MLAAbsorb(GraphPass):
    name = "mla_absorb"
    description = "mla_attention up-projected -> weight-absorbed latent attention (Triton on h100)"

    # The kernel's package and the paged-attention launch code it shares.
    kernel_files = (
        "kernels_generated/mla_attention/__init__.py",
        "kernels_generated/mla_attention/kernels.py",
        "kernels_generated/mla_attention/launch.py",
        "kernels_generated/mla_attention/ops.py",
        "kernels_generated/paged_attention/launch.py",
    )

    def uuid(self) -> str:
        # The emitted graph is written by module-level code and runs the kernel's files.
        h = hashlib.sha256(Path(__file__).read_bytes())
        for path in self.kernel_files:
            h.update((REPO_ROOT / path).read_bytes())
        return h.hexdigest()[:16]

    def apply(self, graph: fx.Graph, ctx: PassContext) -> int:
        if ctx.target == "h100":
            import compile_engine.kernels_generated.mla_attention  # noqa: F401  (registers ce_kernels ops)

            latent_attention = torch.ops.ce_kernels.mla_latent_attention.default
            extra = (ctx.kernel.key,)  # how the kernel config reaches the launch (base.lower)
        else:
            latent_attention, extra = torch.ops.ce.mla_latent_attention.default, ()
        nodes = op_nodes(graph, "mla_attention")
        for node in nodes:
            absorb(graph, node, latent_attention, extra)
        return len(nodes)
