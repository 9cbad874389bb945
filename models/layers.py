"""Blocks shared by the model families: linear layers that know how to load their shards,
norms, rotary, the paged attention layer and the gated MLP."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from compile_engine.models import ops
from compile_engine.models.config import ModelConfig
from compile_engine.models.errors import CheckpointError
from compile_engine.models.rope import cos_sin_table


@dataclass(slots=True)
class AttentionMetadata:
    """What paged attention needs to know about the packed batch (see models/ops.py).

    slot_mapping [T] int64, block_tables [B, max_blocks] int32, seq_lens [B] int32,
    query_start_loc [B + 1] int32. Passed explicitly to forward: no per-step globals.
    """

    slot_mapping: Tensor
    block_tables: Tensor
    seq_lens: Tensor
    query_start_loc: Tensor


class LazyTensor:
    """A checkpoint tensor not read yet: its shape, and the part of it a tensor-parallel rank
    asks for (`lazy[rows, cols]` reads only that slice of the file). The loader yields these
    instead of tensors when the model is sharded (models/parallel.py), so that each rank reads
    its own slices; a module that needs the whole tensor reads it whole."""

    def __init__(self, source, shape: tuple[int, ...]) -> None:
        self._source = source  # safetensors' PySafeSlice: indexing reads
        self.shape = torch.Size(shape)

    def __getitem__(self, index) -> Tensor:
        return self._source[index]

    def read(self) -> Tensor:
        return self._source[tuple(slice(None) for _ in self.shape)]


def _copy_checked(dst: Tensor, src: Tensor | LazyTensor, name: str) -> None:
    if dst.shape != src.shape:
        raise CheckpointError(
            f"tensor {name} has shape {tuple(src.shape)}, the model expects {tuple(dst.shape)}"
        )
    if isinstance(src, LazyTensor):
        src = src.read()
    with torch.no_grad():
        dst.copy_(src)


class Linear(nn.Module):
    """y = x W^T (+ b). Parameters are plain, so quantization can swap the module later."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def load_shard(self, param: Tensor, tensor: Tensor, shard: str | None, name: str) -> None:
        _copy_checked(param, tensor, name)


class LMHead(Linear):
    """The output projection: hidden [S, H] -> logits [S, V]. Its own class so that the
    vocabulary-parallel head (models/parallel.py) can take its place and gather the logits."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__(hidden_size, vocab_size)

    def logits(self, hidden: Tensor) -> Tensor:
        return hidden @ self.weight.t()


class FusedLinear(Linear):
    """Several checkpoint projections stacked along the output dim (q/k/v, gate/up): one GEMM.

    `shards` maps each checkpoint projection name to its output width, in stacking order.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shards.values()), bias)
        self.shards = dict(shards)
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for shard, width in shards.items():
            self.offsets[shard] = (start, start + width)
            start += width

    def load_shard(self, param: Tensor, tensor: Tensor, shard: str | None, name: str) -> None:
        start, end = self.offsets[shard]
        _copy_checked(param[start:end], tensor, name)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)

    def load_shard(self, param: Tensor, tensor: Tensor, shard: str | None, name: str) -> None:
        _copy_checked(param, tensor, name)


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table; rebuilt by `init_buffers` after meta-device construction."""

    def __init__(self, rope: dict, rot_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope, self.rot_dim, self.max_positions = rope, rot_dim, max_positions
        self.register_buffer("cos_sin_cache", torch.empty(max_positions, rot_dim), persistent=False)

    def init_buffers(self) -> None:
        table = cos_sin_table(self.rope, self.rot_dim, self.max_positions)
        self.cos_sin_cache = table.to(self.cos_sin_cache.device)

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return ops.rotary(positions, q, k, self.cos_sin_cache)


class Attention(nn.Module):
    """Self-attention over the packed batch: fused QKV, optional q/k norm, rotary, paged
    attention with the KV write fused, output projection."""

    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = self.head_dim**-0.5
        self.qkv_proj = FusedLinear(
            config.hidden_size,
            {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size},
            bias=config.qkv_bias,
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # One table shared by every layer (64 MB at Llama 3.1's 128k positions).
        self.rotary_emb = rotary_emb
        # An FP8 KV cache's per-tensor scales (models/ops.py `quantize_kv`): the checkpoint's
        # (`self_attn.k_scale` and the other names `load_kv_scale` takes), else 1.0. Float32
        # tensors, not Python floats: the weights are read while the forward is traced, and a
        # kernel reads a tensor's current value where a traced float would stay a constant.
        self.register_buffer("k_scale", torch.ones(()), persistent=False)
        self.register_buffer("v_scale", torch.ones(()), persistent=False)

    def init_buffers(self) -> None:
        device = self.k_scale.device
        self.k_scale = torch.ones((), dtype=torch.float32, device=device)
        self.v_scale = torch.ones((), dtype=torch.float32, device=device)

    def load_kv_scale(self, which: str, tensor: Tensor | LazyTensor, name: str) -> None:
        """Fill `k_scale` or `v_scale` from the checkpoint tensor `name` (one value)."""
        if tensor.shape.numel() != 1:
            raise CheckpointError(
                f"{name}: a KV-cache scale must hold one value (per tensor), got shape "
                f"{tuple(tensor.shape)}"
            )
        if isinstance(tensor, LazyTensor):
            tensor = tensor.read()
        with torch.no_grad():
            getattr(self, which).copy_(tensor.reshape(()).float())

    def forward(
        self, positions: Tensor, hidden: Tensor, kv_cache: Tensor, meta: AttentionMetadata
    ) -> Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, (Hq + 2 Hkv) D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = ops.paged_attention(
            q,
            k,
            v,
            kv_cache,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.scale,
            self.k_scale,
            self.v_scale,
        )  # [T, Hq, D]
        return self.o_proj(out.view(num_tokens, self.q_size))


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one GEMM."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = FusedLinear(
            config.hidden_size, {"gate_proj": size, "up_proj": size}, bias=config.mlp_bias
        )
        self.down_proj = Linear(size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))  # [T, 2I] -> [T, I] -> [T, H]


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: Tensor) -> Tensor:
        return F.embedding(input_ids, self.weight)

    def logits(self, hidden: Tensor) -> Tensor:
        """The tied output projection: hidden [S, H] -> logits [S, V]."""
        return hidden @ self.weight.t()

    def load_shard(self, param: Tensor, tensor: Tensor, shard: str | None, name: str) -> None:
        _copy_checked(param, tensor, name)
