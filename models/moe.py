"""Mixture of experts as stage-level ops, and the sparse MoE block that calls them.

A sparse MoE layer over a packed batch of T tokens, with E experts of which each token uses K:

    logits = gate(x)                                          # [T, E]
    weights, ids = moe_route(logits, ...)                     # [T, K] float32, [T, K] int32
    sorted_ids, block_expert = moe_align(ids, E, BLOCK)       # slots grouped by expert
    h = moe_grouped_gemm(x, w13, sorted_ids, block_expert, K)     # [T*K, 2I] slot s: x[s // K]
    a = silu_and_mul(h)                                       # [T*K, I]
    y = moe_grouped_gemm(a, w2, sorted_ids, block_expert, 1)      # [T*K, H]
    out = moe_combine(y, weights)                             # [T, H]: sum_k weights * y
    out += shared_expert(x) (* sigmoid(shared_expert_gate(x)) for Qwen2-MoE)

A *slot* is one (token, choice) pair, s = t * K + k. Every stage is a `ce` custom op with a
plain-PyTorch reference (the test oracle) and a fake, like the ops of models/ops.py, so a pass
sees five nodes it can match instead of one opaque block or a soup of index ops.
`passes/moe_grouped_gemm.py` replaces the align -> GEMM -> silu_and_mul -> GEMM -> combine chain
with one Triton grouped-GEMM op (kernels_generated/moe_grouped_gemm.py).

Layout of the alignment (the one the Triton kernel consumes): `sorted_ids [P]` lists the slots
expert by expert, each expert's run padded with the sentinel `T*K` to a multiple of BLOCK, so a
block of BLOCK rows belongs to one expert; `block_expert [P / BLOCK]` names that expert, -1 for
blocks past the end. P is an upper bound computed from T alone (`align_capacity`), so shapes
never depend on routing: no host synchronisation, safe inside a CUDA graph.

Routing knobs (`moe_route`), covering Mixtral, Qwen2/3-MoE and DeepSeek-V2/V3:
- scoring_func: "softmax" (Mixtral, Qwen, DeepSeek-V2) or "sigmoid" (DeepSeek-V3).
- topk_method: "greedy" (top-K of the scores); "group_limited_greedy" (DeepSeek-V2: experts in
  n_group groups, a group scores its best expert, only the topk_group best groups compete);
  "noaux_tc" (DeepSeek-V3: a group scores the sum of its two best experts, computed on
  scores + e_score_correction_bias).
- e_score_correction_bias: added to the scores for *selection only*; the weights stay the
  unbiased scores of the chosen experts.
- norm_topk_prob: divide the K weights by their sum (Mixtral: always; Qwen: per config).
- routed_scaling_factor: multiplies the final weights (DeepSeek; 1.0 elsewhere).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.library import custom_op

from compile_engine.models import ops
from compile_engine.models.config import ModelConfig
from compile_engine.models.errors import CheckpointError, UnsupportedModelError
from compile_engine.models.layers import GatedMLP, Linear, _copy_checked

SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
ALIGN_BLOCK = 16  # rows per expert block in the model's graph: tl.dot's minimum tile

# --------------------------------------------------------------------------- moe_route


def moe_route_ref(
    router_logits: Tensor,
    correction_bias: Tensor | None,
    top_k: int,
    scoring_func: str,
    topk_method: str,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[Tensor, Tensor]:
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if scoring_func == "softmax" else logits.sigmoid()  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if topk_method != "greedy" and n_group > 1:
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)  # [T, G, E/G]
        if topk_method == "group_limited_greedy":
            group_scores = grouped.amax(dim=-1)  # [T, G]
        else:  # noaux_tc
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best_groups = group_scores.topk(topk_group, dim=-1).indices  # [T, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices  # [T, K]
    weights = scores.gather(1, ids)  # the unbiased scores of the chosen experts
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int32)


@custom_op("ce::moe_route", mutates_args=())
def moe_route(
    router_logits: Tensor,
    correction_bias: Tensor | None,
    top_k: int,
    scoring_func: str,
    topk_method: str,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[Tensor, Tensor]:
    """router_logits [T, E] -> (topk_weights [T, K] float32, topk_ids [T, K] int32).
    correction_bias [E] or None (selection only). See the module docstring for the knobs."""
    return moe_route_ref(
        router_logits,
        correction_bias,
        top_k,
        scoring_func,
        topk_method,
        n_group,
        topk_group,
        norm_topk_prob,
        routed_scaling_factor,
    )


@moe_route.register_fake
def _(router_logits, correction_bias, top_k, scoring_func, topk_method, n_group, topk_group,
      norm_topk_prob, routed_scaling_factor):  # fmt: skip
    shape = (router_logits.shape[0], top_k)
    return (
        router_logits.new_empty(shape, dtype=torch.float32),
        router_logits.new_empty(shape, dtype=torch.int32),
    )


# --------------------------------------------------------------------------- moe_align


def align_capacity(num_slots, num_experts: int, block: int):
    """Rows of `sorted_ids`: an upper bound on sum_e roundup(count_e, block) that depends on
    shapes only. At most min(slots, experts) experts are busy and each wastes < block rows,
    so decode (1 token, 8 of 128 experts) gets 8 blocks, not 128. Works on SymInts."""
    busy = torch.sym_min(num_slots, num_experts)
    return (num_slots + busy * (block - 1)) // block * block


def moe_align_ref(topk_ids: Tensor, num_experts: int, block: int) -> tuple[Tensor, Tensor]:
    flat = topk_ids.flatten().long()  # [S] expert of each slot
    num_slots = flat.numel()
    capacity = align_capacity(num_slots, num_experts, block)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    padded = (counts + block - 1) // block * block
    ends = padded.cumsum(0)  # [E] end of each expert's padded run
    order = torch.argsort(flat, stable=True)  # slots, expert by expert
    expert_of = flat[order]
    rank = torch.arange(num_slots, device=flat.device) - (counts.cumsum(0) - counts)[expert_of]
    dest = (ends - padded)[expert_of] + rank
    sorted_ids = torch.full((capacity,), num_slots, dtype=torch.int32, device=flat.device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, capacity, block, device=flat.device)  # [P / block]
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_start < ends[-1], block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


@custom_op("ce::moe_align", mutates_args=())
def moe_align(topk_ids: Tensor, num_experts: int, block: int) -> tuple[Tensor, Tensor]:
    """topk_ids [T, K] -> (sorted_ids [P] int32, block_expert [P / block] int32): slots grouped
    by expert, each expert's run padded to `block` rows with the sentinel T*K; the expert of
    each block, -1 past the last. P = align_capacity(T*K, E, block)."""
    return moe_align_ref(topk_ids, num_experts, block)


@moe_align.register_fake
def _(topk_ids: Tensor, num_experts: int, block: int) -> tuple[Tensor, Tensor]:
    capacity = align_capacity(topk_ids.shape[0] * topk_ids.shape[1], num_experts, block)
    return (
        topk_ids.new_empty((capacity,), dtype=torch.int32),
        topk_ids.new_empty((capacity // block,), dtype=torch.int32),
    )


# --------------------------------------------------------------------------- moe_grouped_gemm


def moe_grouped_gemm_ref(
    a: Tensor, w: Tensor, sorted_ids: Tensor, block_expert: Tensor, rows_per_token: int
) -> Tensor:
    num_slots = a.shape[0] * rows_per_token
    out = a.new_zeros(num_slots, w.shape[1])
    if block_expert.numel() == 0:
        return out
    rows = sorted_ids.view(block_expert.numel(), -1).long()  # [blocks, block]
    # A loop over the experts present (a host synchronisation): the plainest correct form.
    # The Triton lowering does the same work in one launch without synchronising.
    for expert in block_expert.unique().tolist():
        if expert < 0:
            continue
        slots = rows[block_expert == expert].flatten()
        slots = slots[slots < num_slots]
        out[slots] = a[slots // rows_per_token] @ w[expert].t()
    return out


@custom_op("ce::moe_grouped_gemm", mutates_args=())
def moe_grouped_gemm(
    a: Tensor, w: Tensor, sorted_ids: Tensor, block_expert: Tensor, rows_per_token: int
) -> Tensor:
    """Per-slot expert GEMM: out[s] = a[s // rows_per_token] @ w[expert(s)]^T, out [M * r, N].

    a [M, K_in]; w [E, N, K_in] (stacked expert weights); sorted_ids, block_expert from
    moe_align. rows_per_token is K for the first GEMM (a = the tokens, each read by its K
    slots) and 1 for the second (a = the slots)."""
    return moe_grouped_gemm_ref(a, w, sorted_ids, block_expert, rows_per_token)


@moe_grouped_gemm.register_fake
def _(a: Tensor, w: Tensor, sorted_ids: Tensor, block_expert: Tensor, rows_per_token: int):
    return a.new_empty((a.shape[0] * rows_per_token, w.shape[1]))


# --------------------------------------------------------------------------- moe_combine


def moe_combine_ref(expert_out: Tensor, topk_weights: Tensor) -> Tensor:
    num_tokens, top_k = topk_weights.shape
    y = expert_out.view(num_tokens, top_k, expert_out.shape[-1])  # [T, K, H]
    return (y.float() * topk_weights.float().unsqueeze(-1)).sum(dim=1).to(expert_out.dtype)


@custom_op("ce::moe_combine", mutates_args=())
def moe_combine(expert_out: Tensor, topk_weights: Tensor) -> Tensor:
    """expert_out [T*K, H] (slot order), topk_weights [T, K] -> sum_k weight * row, [T, H]
    (accumulated in float32)."""
    return moe_combine_ref(expert_out, topk_weights)


@moe_combine.register_fake
def _(expert_out: Tensor, topk_weights: Tensor) -> Tensor:
    return expert_out.new_empty((topk_weights.shape[0], expert_out.shape[-1]))


MOE_OPS = {
    "moe_route": (moe_route, moe_route_ref),
    "moe_align": (moe_align, moe_align_ref),
    "moe_grouped_gemm": (moe_grouped_gemm, moe_grouped_gemm_ref),
    "moe_combine": (moe_combine, moe_combine_ref),
}
HOST_SYNC_OPS = frozenset({"moe_grouped_gemm"})  # its reference loops over the experts present


# --------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class MoEConfig(ModelConfig):
    """ModelConfig plus the numbers of a sparse MoE decoder (defaults: no MoE).

    sparse_layers: indices of the decoder layers whose MLP is a SparseMoE; the others keep a
    dense GatedMLP of `intermediate_size`. Shared experts: a GatedMLP of
    `shared_expert_intermediate_size` beside the routed ones (0: none), scaled by
    sigmoid(shared_expert_gate(x)) when `shared_expert_gate` (Qwen2-MoE)."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    sparse_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    e_score_correction_bias: bool = False
    router_fp32: bool = False  # router GEMM in float32 (DeepSeek); else in the model dtype


def sparse_layer_indices(num_layers: int, step: int = 1, dense: tuple[int, ...] = ()) -> tuple:
    """Qwen-MoE's rule: layer i is sparse iff (i + 1) % decoder_sparse_step == 0 and i is not in
    mlp_only_layers. (DeepSeek's first_k_dense_replace is dense = range(k).)"""
    return tuple(i for i in range(num_layers) if (i + 1) % max(step, 1) == 0 and i not in dense)


def validate_moe_config(config: MoEConfig) -> None:
    """Reject routing settings this engine does not implement, with what to change."""
    if config.num_experts <= 0 or not 0 < config.num_experts_per_tok <= config.num_experts:
        raise UnsupportedModelError(
            f"MoE needs 0 < num_experts_per_tok ({config.num_experts_per_tok}) <= num_experts "
            f"({config.num_experts}); check the config"
        )
    if config.scoring_func not in SCORING_FUNCS:
        raise UnsupportedModelError(
            f"scoring_func {config.scoring_func!r} is not supported; use one of {SCORING_FUNCS}"
        )
    if config.topk_method not in TOPK_METHODS:
        raise UnsupportedModelError(
            f"topk_method {config.topk_method!r} is not supported; use one of {TOPK_METHODS}"
        )
    if config.topk_method != "greedy" and config.n_group > 1:
        per_group = config.num_experts // config.n_group
        if config.num_experts % config.n_group or not 0 < config.topk_group <= config.n_group:
            raise UnsupportedModelError(
                f"grouped top-k needs num_experts ({config.num_experts}) divisible by n_group "
                f"({config.n_group}) and 0 < topk_group ({config.topk_group}) <= n_group"
            )
        if config.topk_method == "noaux_tc" and per_group < 2:
            raise UnsupportedModelError("noaux_tc scores a group by its 2 best experts: n_group "
                                        "must leave at least 2 experts per group")  # fmt: skip
        if config.topk_group * per_group < config.num_experts_per_tok:
            raise UnsupportedModelError(
                f"topk_group ({config.topk_group}) groups of {per_group} experts cannot supply "
                f"num_experts_per_tok ({config.num_experts_per_tok})"
            )


# --------------------------------------------------------------------------- modules


class Router(nn.Module):
    """The gate: logits = x W^T, W [E, H]; optionally DeepSeek-V3's per-expert selection bias
    (`e_score_correction_bias`, the checkpoint's name)."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool, fp32: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.fp32 = fp32
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(num_experts), requires_grad=False
            )
        else:
            self.e_score_correction_bias = None

    def forward(self, x: Tensor) -> Tensor:
        if self.fp32:
            return F.linear(x.float(), self.weight.float())  # [T, E] float32
        return F.linear(x, self.weight)  # [T, E]

    def load_shard(self, param: Tensor, tensor: Tensor, shard: str | None, name: str) -> None:
        _copy_checked(param, tensor, name)


class StackedExperts(nn.Module):
    """All experts' weights as two stacked parameters, which the grouped GEMM indexes by
    expert: w13 [E, 2I, H] (gate rows then up rows, like gate_up_proj) and w2 [E, H, I].

    `shards` says which per-expert checkpoint projections stack into each parameter, in order
    along dim 1: e.g. {"w13": ("w1", "w3"), "w2": ("w2",)} for Mixtral. The loader fills a
    parameter either from the per-expert tensors `<prefix>.<e>.<proj>.weight` (shard (proj, e))
    or from one already-stacked tensor (transformers 5's gate_up_proj / down_proj, shard None).
    """

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int,
        shards: dict[str, tuple[str, ...]],
    ) -> None:  # fmt: skip
        super().__init__()
        if set(shards) != {"w13", "w2"} or len(shards["w13"]) != 2 or len(shards["w2"]) != 1:
            raise ValueError(f"shards must map w13 to (gate, up) and w2 to (down,), got {shards}")
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.shards = {k: tuple(v) for k, v in shards.items()}
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False
        )

    def forward(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        top_k = topk_ids.shape[1]
        sorted_ids, block_expert = moe_align(topk_ids, self.num_experts, ALIGN_BLOCK)
        h = moe_grouped_gemm(x, self.w13, sorted_ids, block_expert, top_k)  # [T*K, 2I]
        a = ops.silu_and_mul(h)  # [T*K, I]
        y = moe_grouped_gemm(a, self.w2, sorted_ids, block_expert, 1)  # [T*K, H]
        return moe_combine(y, topk_weights)  # [T, H]

    def load_shard(self, param: Tensor, tensor: Tensor, shard, name: str) -> None:
        if shard is None:
            _copy_checked(param, tensor, name)
            return
        proj, expert = shard
        projs = self.shards["w13" if param is self.w13 else "w2"]
        if not 0 <= expert < self.num_experts:
            raise CheckpointError(
                f"tensor {name} is for expert {expert}, but the config has {self.num_experts} "
                "experts (is the config right for these weights?)"
            )
        width = param.shape[1] // len(projs)
        index = projs.index(proj)
        _copy_checked(param[expert, index * width : (index + 1) * width], tensor, name)


class SparseMoE(nn.Module):
    """Router + routed experts (+ shared experts), over a packed batch x [T, H] -> [T, H].

        SparseMoE(config, shards={"w13": ("w1", "w3"), "w2": ("w2",)},  # Mixtral names
                  shared_expert_name="shared_expert")                  # Qwen2-MoE
        SparseMoE(config, shards={"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)},
                  shared_expert_name="shared_experts")                 # DeepSeek

    config: a MoEConfig (or subclass): num_experts, num_experts_per_tok, moe_intermediate_size,
    the routing knobs (scoring_func, topk_method, n_group, topk_group, norm_topk_prob,
    routed_scaling_factor, e_score_correction_bias, router_fp32) and the shared expert
    (shared_expert_intermediate_size > 0, shared_expert_gate). For DeepSeek's n_shared_experts,
    set shared_expert_intermediate_size = n_shared_experts * moe_intermediate_size.

    Parameters, named as the checkpoints name them: gate.weight [E, H] (and
    gate.e_score_correction_bias [E]), experts.w13 [E, 2I, H], experts.w2 [E, H, I],
    <shared_expert_name>.gate_up_proj / .down_proj, shared_expert_gate.weight [1, H]. The model
    class declares the same `shards` as its `stacked_modules` table, which the loader reads.
    """

    def __init__(
        self,
        config: MoEConfig,
        *,
        shards: dict[str, tuple[str, ...]],
        shared_expert_name: str = "shared_expert",
    ) -> None:
        super().__init__()
        validate_moe_config(config)
        self.config = config
        self.top_k = config.num_experts_per_tok
        self.gate = Router(
            config.hidden_size,
            config.num_experts,
            config.e_score_correction_bias,
            config.router_fp32,
        )
        self.experts = StackedExperts(
            config.num_experts, config.hidden_size, config.moe_intermediate_size, shards
        )
        self.shared_expert_name = None
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert_name = shared_expert_name
            shared_config = dataclasses.replace(
                config, intermediate_size=config.shared_expert_intermediate_size
            )
            self.add_module(shared_expert_name, GatedMLP(shared_config))
        self.shared_expert_gate = (
            Linear(config.hidden_size, 1) if config.shared_expert_gate else None
        )

    def forward(self, x: Tensor) -> Tensor:
        cfg = self.config
        logits = self.gate(x)  # [T, E]
        weights, ids = moe_route(
            logits,
            self.gate.e_score_correction_bias,
            self.top_k,
            cfg.scoring_func,
            cfg.topk_method,
            cfg.n_group,
            cfg.topk_group,
            cfg.norm_topk_prob,
            cfg.routed_scaling_factor,
        )  # [T, K] float32, [T, K] int32
        out = self.experts(x, weights, ids)  # [T, H]
        if self.shared_expert_name is not None:
            shared = getattr(self, self.shared_expert_name)(x)  # [T, H]
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared  # [T, 1] * [T, H]
            out = out + shared
        return out
