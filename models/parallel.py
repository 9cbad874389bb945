"""Tensor and expert parallelism by composition: sharded modules, and the swap that puts them
into a model built on the meta device (before it has any storage).

Megatron's split, one all-reduce per block half:

    embed_tokens    vocabulary-parallel: rank r holds rows [r V/W, (r+1) V/W) (V padded to a
                    multiple of W); a token outside them looks up zeros; all-reduce   # [T, H]
    qkv_proj        column-parallel by heads: the rank's Hq/W query heads and their KV heads
                    (Hkv/W of them, or, with fewer KV heads than ranks, the one KV head its
                    query heads read, replicated on W/Hkv ranks)                       # [T, local]
    paged attention on the rank's heads only; its KV cache holds only those heads
    o_proj          row-parallel: the rank's input columns, then all-reduce            # [T, H]
    gate_up_proj    column-parallel: rows [r I/W, (r+1) I/W) of gate and of up
    down_proj       row-parallel, then all-reduce
    MoE experts     tensor-parallel (each expert's intermediate split as gate_up/down), or
                    expert-parallel (rank r holds experts [r E/W, (r+1) E/W) whole); the
                    router is replicated, and the routed + shared experts' partial sums are
                    all-reduced once
    MLA             q(_b)_proj and kv_b_proj column-parallel by heads, o_proj row-parallel; the
                    latent down-projections and the latent cache are replicated (one latent
                    row per token serves every head, as in vLLM)
    lm_head         vocabulary-parallel; the logits are all-gathered                   # [S, V]

Norms, the router and rotary tables are replicated. The collectives are the functional ops
of `torch.ops._c10d_functional` (out of place, then `wait_tensor`), so Dynamo puts them in the
FX graph as nodes that passes see (passes/all_reduce_norm.py fuses the all-reduce with the
add + rms_norm after it) and Inductor schedules.

Loading: each sharded parameter knows its slice of the checkpoint tensor (`load_shard`), and
the loader hands it a `LazyTensor` (models/layers.py) under tensor parallelism, so a rank
reads only its slices of a safetensors file. A GGUF tensor is dequantized whole and then
sliced: llama.cpp's quantized blocks are not addressable by row ranges without decoding.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.library import custom_op

from compile_engine.models import ops
from compile_engine.models.config import ModelConfig
from compile_engine.models.deepseek import MLAttention
from compile_engine.models.errors import CheckpointError, UnsupportedModelError
from compile_engine.models.layers import (
    Attention,
    Embedding,
    FusedLinear,
    GatedMLP,
    LazyTensor,
    Linear,
    LMHead,
    _copy_checked,
)
from compile_engine.models.moe import (
    ALIGN_BLOCK,
    SparseMoE,
    StackedExperts,
    moe_align,
    moe_combine,
    moe_grouped_gemm,
)


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This rank's place in the tensor-parallel group, as the sharded modules need it."""

    rank: int
    world_size: int
    group_name: str  # the process group's name, which the functional collectives take
    expert_parallel: bool = False  # MoE experts split whole across ranks instead of sliced

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.world_size}")


# --------------------------------------------------------------------------- collectives


def all_reduce(x: Tensor, group_name: str) -> Tensor:
    """Sum of `x` over the group, as functional ops the compiler sees."""
    c10d = torch.ops._c10d_functional
    # The overloads, not the packets, so that the graph's nodes name them (what passes match).
    return c10d.wait_tensor.default(c10d.all_reduce.default(x, "sum", group_name))


def all_gather_last(x: Tensor, world_size: int, group_name: str) -> Tensor:
    """[S, n] on each rank -> [S, world_size * n], rank 0's columns first."""
    c10d = torch.ops._c10d_functional
    gathered = c10d.all_gather_into_tensor.default(x.contiguous(), world_size, group_name)
    stacked = c10d.wait_tensor.default(gathered)
    # [W S, n] -> [W, S, n] -> [S, W, n] -> [S, W n]
    return stacked.view(world_size, *x.shape).movedim(0, -2).flatten(-2)


def all_reduce_add_rms_norm_ref(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, group_name: str
) -> tuple[Tensor, Tensor]:
    """The fused op's meaning: all-reduce x, then add the residual and rms_norm the sum."""
    return ops.add_rms_norm_ref(all_reduce(x, group_name), residual, weight, eps)


@custom_op("ce::all_reduce_add_rms_norm", mutates_args=())
def all_reduce_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, group_name: str
) -> tuple[Tensor, Tensor]:
    """(rms_norm(all_reduce(x) + residual), all_reduce(x) + residual): a row-parallel
    projection's reduction and the next norm as one op, which a kernel may fuse (one pass
    over the reduced rows). Written by passes/all_reduce_norm.py, not by models."""
    return all_reduce_add_rms_norm_ref(x, residual, weight, eps, group_name)


@all_reduce_add_rms_norm.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float, group_name: str):
    return torch.empty_like(x), torch.empty_like(x)


PARALLEL_OPS = {"all_reduce_add_rms_norm": (all_reduce_add_rms_norm, all_reduce_add_rms_norm_ref)}


# --------------------------------------------------------------------------- slicing


def _split(size: int, tp: TensorParallel, what: str) -> tuple[int, int]:
    """The rank's equal part [start, end) of `size`, which the group must divide."""
    if size % tp.world_size:
        raise UnsupportedModelError(
            f"tensor_parallel_size={tp.world_size} does not divide {what}={size}; use a "
            "tensor_parallel_size that divides it"
        )
    per = size // tp.world_size
    return tp.rank * per, (tp.rank + 1) * per


def _padded_split(size: int, tp: TensorParallel) -> tuple[int, int]:
    """The rank's rows of a vocabulary padded to a multiple of the group size."""
    per = math.ceil(size / tp.world_size)
    return tp.rank * per, (tp.rank + 1) * per


def _copy_part(
    dst: Tensor,
    src: Tensor | LazyTensor,
    dim: int,
    span: tuple[int, int],
    full: int,
    name: str,
) -> None:
    """dst <- src[..., start:end, ...] along `dim`, where src is `full` long there; rows of
    the span past the end (a padded vocabulary) are zeros. Reads only the slice of a lazy
    checkpoint tensor."""
    expected = list(dst.shape)
    expected[dim] = full
    if list(src.shape) != expected:
        raise CheckpointError(
            f"tensor {name} has shape {tuple(src.shape)}, the model expects {tuple(expected)}"
        )
    start, end = span
    stop = max(start, min(end, full))
    with torch.no_grad():
        if stop > start:
            dst.narrow(dim, 0, stop - start).copy_(
                src[(slice(None),) * dim + (slice(start, stop),)]
            )
        if stop < end:
            dst.narrow(dim, stop - start, end - stop).zero_()


# --------------------------------------------------------------------------- linear layers


class ColumnParallelLinear(Linear):
    """Output rows [start, end) of a checkpoint's [out, in] projection (and of its bias)."""

    def __init__(
        self, in_features: int, rows: tuple[int, int], full: int, bias: bool = False
    ) -> None:
        super().__init__(in_features, rows[1] - rows[0], bias)
        self.rows, self.full = rows, full

    def load_shard(self, param: Tensor, tensor, shard: str | None, name: str) -> None:
        _copy_part(param, tensor, 0, self.rows, self.full, name)


class ShardedFusedLinear(FusedLinear):
    """A FusedLinear (q/k/v, gate/up) holding a slice of each checkpoint projection:
    `parts` maps each projection to (start, end, its full width)."""

    def __init__(
        self, in_features: int, parts: dict[str, tuple[int, int, int]], bias: bool = False
    ) -> None:
        super().__init__(
            in_features, {k: end - start for k, (start, end, _) in parts.items()}, bias
        )
        self.parts = dict(parts)

    def load_shard(self, param: Tensor, tensor, shard: str | None, name: str) -> None:
        local_start, local_end = self.offsets[shard]
        start, end, full = self.parts[shard]
        _copy_part(param[local_start:local_end], tensor, 0, (start, end), full, name)


class RowParallelLinear(Linear):
    """Input columns [start, end) of a checkpoint's [out, in] projection: a partial sum of the
    full output, all-reduced here (`reduce`) or by the caller (an MoE block sums its routed and
    shared experts first, then reduces once). The bias is added once, after the sum."""

    def __init__(
        self,
        cols: tuple[int, int],
        full: int,
        out_features: int,
        bias: bool,
        tp: TensorParallel,
        reduce: bool = True,
    ) -> None:
        super().__init__(cols[1] - cols[0], out_features, bias)
        self.cols, self.full, self.tp, self.reduce = cols, full, tp, reduce

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight)  # [T, out], this rank's part of the sum
        if self.reduce:
            y = all_reduce(y, self.tp.group_name)
        if self.bias is not None and (self.reduce or self.tp.rank == 0):
            y = y + self.bias
        return y

    def load_shard(self, param: Tensor, tensor, shard: str | None, name: str) -> None:
        if param is self.bias:
            _copy_checked(param, tensor, name)
        else:
            _copy_part(param, tensor, 1, self.cols, self.full, name)


class VocabParallelEmbedding(Embedding):
    """Rows [start, end) of the embedding (the vocabulary padded to a multiple of the group);
    each token is looked up on the rank that holds it, zeros elsewhere, then summed. As the
    tied output projection, each rank scores its rows and the logits are gathered."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        self.span = _padded_split(vocab_size, tp)
        super().__init__(self.span[1] - self.span[0], hidden_size)
        self.vocab_size, self.tp = vocab_size, tp

    def forward(self, input_ids: Tensor) -> Tensor:
        local = input_ids - self.span[0]  # [T]
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, H]
        return all_reduce(out.masked_fill(outside.unsqueeze(-1), 0), self.tp.group_name)

    def logits(self, hidden: Tensor) -> Tensor:
        local = hidden @ self.weight.t()  # [S, V / W]
        gathered = all_gather_last(local, self.tp.world_size, self.tp.group_name)
        return gathered[:, : self.vocab_size]  # [S, V]: the padding's columns dropped

    def load_shard(self, param: Tensor, tensor, shard: str | None, name: str) -> None:
        _copy_part(param, tensor, 0, self.span, self.vocab_size, name)


class VocabParallelHead(LMHead):
    """lm_head's rows [start, end) of the (padded) vocabulary; the logits are gathered."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel) -> None:
        self.span = _padded_split(vocab_size, tp)
        super().__init__(hidden_size, self.span[1] - self.span[0])
        self.vocab_size, self.tp = vocab_size, tp

    def logits(self, hidden: Tensor) -> Tensor:
        local = hidden @ self.weight.t()  # [S, V / W]
        gathered = all_gather_last(local, self.tp.world_size, self.tp.group_name)
        return gathered[:, : self.vocab_size]

    def load_shard(self, param: Tensor, tensor, shard: str | None, name: str) -> None:
        _copy_part(param, tensor, 0, self.span, self.vocab_size, name)


# --------------------------------------------------------------------------- attention, MLP


def kv_heads_of(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """(first KV head, count) that rank's query heads read. With fewer KV heads than ranks,
    each rank keeps the one its query heads share, replicated on world/num_kv_heads ranks."""
    world = tp.world_size
    if num_kv_heads >= world:
        first, _ = _split(num_kv_heads, tp, "num_key_value_heads")
        return first, num_kv_heads // world
    if world % num_kv_heads:
        raise UnsupportedModelError(
            f"num_key_value_heads={num_kv_heads} and tensor_parallel_size={world}: with fewer "
            "KV heads than ranks, the ranks must be a multiple of the KV heads (each KV head "
            "replicated on the same number of ranks)"
        )
    q_first, _ = _split(num_heads, tp, "num_attention_heads")
    return q_first // (num_heads // num_kv_heads), 1


def parallel_attention(attn: Attention, config: ModelConfig, tp: TensorParallel) -> Attention:
    """The rank's heads of a Llama-family attention block."""
    q_first, q_end = _split(config.num_heads, tp, "num_attention_heads")
    kv_first, kv_count = kv_heads_of(config.num_heads, config.num_kv_heads, tp)
    local = dataclasses.replace(config, num_heads=q_end - q_first, num_kv_heads=kv_count)
    out = Attention(local, attn.rotary_emb)
    d = config.head_dim
    kv = (kv_first * d, (kv_first + kv_count) * d, config.kv_size)
    out.qkv_proj = ShardedFusedLinear(
        config.hidden_size,
        {"q_proj": (q_first * d, q_end * d, config.q_size), "k_proj": kv, "v_proj": kv},
        bias=config.qkv_bias,
    )
    out.o_proj = RowParallelLinear(
        (q_first * d, q_end * d), config.q_size, config.hidden_size, config.o_bias, tp
    )
    return out


def parallel_mla(attn: MLAttention, config, tp: TensorParallel) -> MLAttention:
    """The rank's heads of DeepSeek's MLA: per-head up-projections sliced, latent replicated."""
    first, end = _split(config.num_heads, tp, "num_attention_heads")
    out = MLAttention(dataclasses.replace(config, num_heads=end - first), attn.rotary_emb)
    qk, kv_b, v = config.qk_head_dim, config.qk_nope_head_dim + config.v_head_dim, config.v_head_dim
    heads = config.num_heads
    q_rows = (first * qk, end * qk)
    if config.q_lora_rank is None:
        out.q_proj = ColumnParallelLinear(config.hidden_size, q_rows, heads * qk)
    else:
        out.q_b_proj = ColumnParallelLinear(config.q_lora_rank, q_rows, heads * qk)
    out.kv_b_proj = ColumnParallelLinear(
        config.kv_lora_rank, (first * kv_b, end * kv_b), heads * kv_b
    )
    out.o_proj = RowParallelLinear(
        (first * v, end * v), heads * v, config.hidden_size, config.attention_bias, tp
    )
    return out


def parallel_mlp(mlp: GatedMLP, tp: TensorParallel, reduce: bool = True) -> GatedMLP:
    """gate_up column-parallel, down row-parallel (reduced here unless `reduce` is False)."""
    hidden, inter = mlp.down_proj.weight.shape
    start, end = _split(inter, tp, "intermediate_size")
    bias = mlp.down_proj.bias is not None
    mlp.gate_up_proj = ShardedFusedLinear(
        hidden, {"gate_proj": (start, end, inter), "up_proj": (start, end, inter)}, bias=bias
    )
    mlp.down_proj = RowParallelLinear((start, end), inter, hidden, bias, tp, reduce)
    return mlp


# --------------------------------------------------------------------------- MoE


def _take(src, index, shape: tuple[int, ...], name: str) -> Tensor:
    if tuple(src.shape) != tuple(shape):
        raise CheckpointError(
            f"tensor {name} has shape {tuple(src.shape)}, the model expects {tuple(shape)}"
        )
    return src[index]


class TensorParallelExperts(StackedExperts):
    """Every expert, with rows [start, end) of its intermediate: w13 [E, 2 I/W, H] (gate's
    slice, then up's), w2 [E, H, I/W]. The output is a partial sum."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, shards,
                 tp: TensorParallel) -> None:  # fmt: skip
        self.span = _split(intermediate_size, tp, "moe_intermediate_size")
        super().__init__(num_experts, hidden_size, self.span[1] - self.span[0], shards)
        self.full_intermediate = intermediate_size

    def load_shard(self, param: Tensor, tensor, shard, name: str) -> None:
        (a, b), full, local = self.span, self.full_intermediate, self.intermediate_size
        experts, hidden = self.num_experts, self.w13.shape[2]
        with torch.no_grad():
            if param is self.w13 and shard is None:  # stacked [E, 2I, H]
                shape = (experts, 2 * full, hidden)
                param[:, :local].copy_(_take(tensor, (slice(None), slice(a, b)), shape, name))
                up = (slice(None), slice(full + a, full + b))
                param[:, local:].copy_(_take(tensor, up, shape, name))
            elif param is self.w2 and shard is None:  # stacked [E, H, I]
                index = (slice(None), slice(None), slice(a, b))
                param.copy_(_take(tensor, index, (experts, hidden, full), name))
            else:
                proj, expert = shard
                _check_expert(expert, experts, name)
                if param is self.w13:  # [I, H] of gate or up
                    at = self.shards["w13"].index(proj) * local
                    rows = _take(tensor, slice(a, b), (full, hidden), name)
                    param[expert, at : at + local].copy_(rows)
                else:  # [H, I] of down
                    cols = _take(tensor, (slice(None), slice(a, b)), (hidden, full), name)
                    param[expert].copy_(cols)


def _check_expert(expert: int, num_experts: int, name: str) -> None:
    if not 0 <= expert < num_experts:
        raise CheckpointError(
            f"tensor {name} is for expert {expert}, but the config has {num_experts} experts "
            "(is the config right for these weights?)"
        )


class ExpertParallelExperts(StackedExperts):
    """Experts [first, first + E/W) whole. `num_experts` stays the model's E (the loader
    expects every expert's tensors and skips, unread, those of other ranks); slots routed to
    another rank's experts go to a sentinel expert past the local ones, whose blocks are
    marked empty (-1, as past the end), so no GEMM runs for them and their weight is zero."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, shards,
                 tp: TensorParallel) -> None:  # fmt: skip
        first, end = _split(num_experts, tp, "num_experts (expert parallel)")
        super().__init__(end - first, hidden_size, intermediate_size, shards)
        self.num_experts, self.num_local, self.first = num_experts, end - first, first

    def forward(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        top_k = topk_ids.shape[1]
        local = topk_ids - self.first  # [T, K] int32
        mine = (local >= 0) & (local < self.num_local)
        local = torch.where(mine, local, self.num_local)  # elsewhere -> the sentinel
        sorted_ids, block_expert = moe_align(local, self.num_local + 1, ALIGN_BLOCK)
        block_expert = torch.where(block_expert == self.num_local, -1, block_expert)
        h = moe_grouped_gemm(x, self.w13, sorted_ids, block_expert, top_k)  # [T*K, 2I]
        a = ops.silu_and_mul(h)  # [T*K, I]
        y = moe_grouped_gemm(a, self.w2, sorted_ids, block_expert, 1)  # [T*K, H]
        return moe_combine(y, topk_weights * mine)  # [T, H], this rank's experts only

    def load_shard(self, param: Tensor, tensor, shard, name: str) -> None:
        first, end = self.first, self.first + self.num_local
        if shard is None:  # stacked [E, ...]
            shape = (self.num_experts, *param.shape[1:])
            with torch.no_grad():
                param.copy_(_take(tensor, slice(first, end), shape, name))
            return
        proj, expert = shard
        _check_expert(expert, self.num_experts, name)
        if not first <= expert < end:
            return  # another rank's expert: never read
        projs = self.shards["w13" if param is self.w13 else "w2"]
        width = param.shape[1] // len(projs)
        index = projs.index(proj)
        _copy_checked(param[expert - first, index * width : (index + 1) * width], tensor, name)


class ParallelSparseMoE(SparseMoE):
    """SparseMoE with sliced (tensor-parallel) or distributed (expert-parallel) experts and a
    tensor-parallel shared expert; their partial sums are all-reduced once, at the end."""

    def __init__(self, moe: SparseMoE, tp: TensorParallel) -> None:
        super().__init__(
            moe.config,
            shards=moe.experts.shards,
            shared_expert_name=moe.shared_expert_name or "shared_expert",
        )
        self.tp = tp
        cfg = moe.config
        kind = ExpertParallelExperts if tp.expert_parallel else TensorParallelExperts
        self.experts = kind(
            cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, self.experts.shards, tp
        )
        if self.shared_expert_name is not None:
            parallel_mlp(getattr(self, self.shared_expert_name), tp, reduce=False)

    def forward(self, x: Tensor) -> Tensor:
        return all_reduce(super().forward(x), self.tp.group_name)  # [T, H]


# --------------------------------------------------------------------------- the swap

# Attention block type -> its tensor-parallel form. A new attention class adds its entry.
PARALLEL_ATTENTION = {Attention: parallel_attention, MLAttention: parallel_mla}
SHARDED = (
    ColumnParallelLinear,
    ShardedFusedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    TensorParallelExperts,
    ExpertParallelExperts,
)


def shard_model(model: nn.Module, tp: TensorParallel) -> None:
    """Swap, in place, every block of a model built on the meta device for the rank's shard
    of it. Raises UnsupportedModelError when the group size does not divide what it splits."""
    config = model.config
    if tp.expert_parallel and not getattr(config, "num_experts", 0):
        raise UnsupportedModelError(
            f"enable_expert_parallel needs a MoE model; {config.architecture} has no experts"
        )
    decoder = model.model
    decoder.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
    for layer in decoder.layers:
        swap = PARALLEL_ATTENTION.get(type(layer.self_attn))
        if swap is None:
            raise UnsupportedModelError(
                f"{type(layer.self_attn).__name__} has no tensor-parallel form"
            )
        layer.self_attn = swap(layer.self_attn, config, tp)
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp = ParallelSparseMoE(layer.mlp, tp)
        else:
            layer.mlp = parallel_mlp(layer.mlp, tp)
    if model.lm_head is not None:
        model.lm_head = VocabParallelHead(config.hidden_size, config.vocab_size, tp)


def is_sharded(model: nn.Module) -> bool:
    return any(isinstance(m, SHARDED) for m in model.modules())
