"""Integer weight-only checkpoint formats (issue 29): GPTQ, AWQ and compressed-tensors
pack-quantized, read into the codes + group scales models/quant.py's integer schemes take, and
written back (tests, `bench make-model --quantize gptq-int4`).

Each format keeps `bits`-bit codes packed `32 // bits` to an int32 word, the lowest bits first,
and one scale (and zero point) per group of `group` input columns:

- gptq (AutoGPTQ / GPTQModel): `qweight` [K / pf, N] packed along K (word [r, n] holds rows
  pf r .. pf r + pf - 1 of column n), `qzeros` [G, N / pf] packed along N, `scales` [G, N]
  float16, `g_idx` [K] int32 the group of each input column. w[n, k] = s[g, n] (q[k, n] -
  z[g, n]) with g = g_idx[k]. checkpoint_format "gptq" (v1, AutoGPTQ) stores z - 1,
  "gptq_v2" (GPTQModel) z itself. desc_act (act-order) quantizes columns in a permuted order,
  so g_idx is not k // group.
- awq (AutoAWQ "gemm" version, 4 bits): `qweight` [K, N / 8] packed along N in AWQ's
  interleaved order (word nibble i holds column 8 c + AWQ_ORDER[i]), `qzeros` [G, N / 8]
  likewise, `scales` [G, N]; w = s (q - z).
- compressed-tensors "pack-quantized" (llm-compressor W4A16 / W8A16): `weight_packed` [N,
  K / pf] packed along K, signed values stored + 2^(bits - 1); `weight_scale` [N, G];
  asymmetric: `weight_zero_point` [N / pf, G] packed along N, stored the same way;
  `weight_g_idx` [K] with actorder "group"; `weight_shape` [2]. w = (q - z) s.

What the loader gets (`unpack_checkpoint`, per linear): `weight` codes [N, K] (uint8, or int8
for the int8 scheme), `weight_scale` float32 [N, G] or [N, G, 2] = (s, z), and with act-order
`input_perm` [K]: the columns sorted by group, so that groups are contiguous runs again
(QuantLinear gathers the activation's columns by it, w[:, perm] against x[:, perm] is the same
product). Symmetric checkpoints become int4 (w = s (q - 8)) / int8 (w = s q, q = stored - 128),
asymmetric ones uint4_zp / uint8_zp (w = (q - z) s): every conversion is exact, the float32
product the only rounding, as the formats' own dequantization. Per-channel scales (group -1,
strategy "channel") are repeated over groups of CHANNEL_GROUP columns: the same weight.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from compile_engine.models.errors import CheckpointError
from compile_engine.models.quant import (
    PackedFormat,
    QuantConfig,
    QuantizationError,
    QuantScheme,
    is_quantized_checkpoint_weight,
)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # word nibble i holds column AWQ_ORDER[i] of its 8
AWQ_REVERSE = tuple(AWQ_ORDER.index(j) for j in range(8))  # column j sits in nibble AWQ_REVERSE[j]
CHANNEL_GROUP = 128  # the group a per-channel scale is repeated over
PACKINGS = ("gptq", "gptq_v2", "awq", "pack-quantized")
# The tensors of one packed linear, by packing (the first is the packed weight).
PARTS = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "pack-quantized": ("weight_packed", "weight_scale", "weight_shape"),
}


def _parts(fmt: PackedFormat) -> tuple[str, ...]:
    if fmt.kind == "pack-quantized":
        extra = () if fmt.symmetric else ("weight_zero_point",)
        return PARTS["pack-quantized"] + extra + (("weight_g_idx",) if fmt.act_order else ())
    if fmt.kind == "awq":
        return PARTS["awq"]
    return PARTS["gptq"]


# --------------------------------------------------------------------------- bit fields


def unpack_int32(words: Tensor, bits: int, dim: int) -> Tensor:
    """int32 words [R, C] -> their `32 // bits` fields each (int32, 0 .. 2^bits - 1), the
    lowest bits first, laid out along `dim`: [R * pf, C] (dim 0) or [R, C * pf] (dim 1)."""
    if words.dtype != torch.int32:
        raise CheckpointError(f"packed weights are int32 words, not {words.dtype}")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    mask = (1 << bits) - 1
    if dim == 0:
        fields = (words[:, None, :] >> shifts[None, :, None]) & mask  # [R, pf, C]
        return fields.reshape(-1, words.shape[1])
    fields = (words[:, :, None] >> shifts) & mask  # [R, C, pf]
    return fields.reshape(words.shape[0], -1)


def pack_int32(values: Tensor, bits: int, dim: int) -> Tensor:
    """The inverse of unpack_int32: fields [R * pf, C] or [R, C * pf] (0 .. 2^bits - 1) ->
    int32 words."""
    pf = 32 // bits
    v = values.to(torch.int64)
    if dim == 0:
        v = v.reshape(-1, pf, v.shape[1])  # [R, pf, C]
        shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=v.device)[None, :, None]
        words = (v << shifts).sum(1)
    else:
        v = v.reshape(v.shape[0], -1, pf)  # [R, C, pf]
        words = (v << torch.arange(0, 32, bits, dtype=torch.int64, device=v.device)).sum(-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # two's complement
    return words.to(torch.int32)


# --------------------------------------------------------------------------- reading


def _scheme_codes(
    codes: Tensor, scale: Tensor, zero: Tensor, fmt: PackedFormat, scheme: QuantScheme, name: str
) -> tuple[Tensor, Tensor]:
    """codes [N, K] (0 .. 2^bits - 1), scale [N, G] float32 and the integer zero points
    [N, G] -> the scheme's (codes, weight_scale): exact either way."""
    mid = 1 << (fmt.bits - 1)
    if scheme.has_zero:
        return codes.to(torch.uint8), torch.stack([scale, zero.float()], dim=-1)
    if not torch.all(zero == mid):
        raise CheckpointError(
            f"{name}: a symmetric checkpoint's zero points must all be {mid} (the config says "
            "sym / symmetric; is it asymmetric?)"
        )
    if scheme.bits == 8:
        return (codes - mid).to(torch.int8), scale
    return codes.to(torch.uint8), scale


def _act_order(
    g_idx: Tensor | None, k: int, group: int, fmt: PackedFormat, name: str
) -> Tensor | None:
    """The permutation that makes act-order groups contiguous (None without act-order); a
    g_idx that is not k // group without act-order is an error."""
    trivial = torch.arange(k) // group
    if g_idx is None:
        return torch.arange(k) if fmt.act_order else None
    g_idx = g_idx.to(torch.int64).reshape(-1)
    if g_idx.numel() != k:
        raise CheckpointError(f"{name}: g_idx has {g_idx.numel()} entries for {k} columns")
    if not fmt.act_order:
        if not torch.equal(g_idx, trivial):
            raise CheckpointError(
                f"{name}: g_idx is not k // group_size, but the config does not say act-order "
                "(desc_act / actorder)"
            )
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], trivial):
        raise CheckpointError(f"{name}: g_idx does not give every group {group} columns")
    return perm


def _expand_channel(scale: Tensor, zero: Tensor, k: int, name: str) -> tuple[Tensor, Tensor]:
    """Per-channel [N, 1] scale and zero point -> groups of CHANNEL_GROUP: the same weight."""
    if k % CHANNEL_GROUP:
        raise QuantizationError(
            f"{name}: per-channel scales run as groups of {CHANNEL_GROUP} columns, and {k} "
            "input features do not divide into them"
        )
    groups = k // CHANNEL_GROUP
    return scale.expand(-1, groups).contiguous(), zero.expand(-1, groups).contiguous()


def unpack_linear(
    parts: dict[str, Tensor], fmt: PackedFormat, scheme: QuantScheme, name: str
) -> dict[str, Tensor]:
    """One packed linear's checkpoint tensors (by part name) -> {"weight": codes [N, K],
    "weight_scale": [N, G(, 2)], and "input_perm" [K] with act-order}."""
    bits = fmt.bits
    g_idx = None
    if fmt.kind == "pack-quantized":
        n, k = (int(v) for v in parts["weight_shape"].reshape(-1).tolist())
        codes = unpack_int32(parts["weight_packed"], bits, 1)[:, :k]  # [N, K]
        scale = parts["weight_scale"].float().reshape(n, -1)  # [N, G]
        if fmt.symmetric:
            zero = torch.full(scale.shape, 1 << (bits - 1), dtype=torch.int32)
        else:
            zero = unpack_int32(parts["weight_zero_point"], bits, 0)[:n]  # [N, G]
        g_idx = parts.get("weight_g_idx")
    elif fmt.kind == "awq":
        pf = 32 // bits
        q = unpack_int32(parts["qweight"], bits, 1)  # [K, N], AWQ's order in each 8
        k = q.shape[0]
        order = torch.tensor(AWQ_REVERSE)
        codes = q.view(k, -1, pf)[:, :, order].reshape(k, -1).t()  # [N, K]
        z = unpack_int32(parts["qzeros"], bits, 1)
        zero = z.view(z.shape[0], -1, pf)[:, :, order].reshape(z.shape[0], -1).t()  # [N, G]
        scale = parts["scales"].float().t()  # [N, G]
        n = codes.shape[0]
    else:  # gptq, gptq_v2
        codes = unpack_int32(parts["qweight"], bits, 0).t()  # [N, K]
        n, k = codes.shape
        zero = unpack_int32(parts["qzeros"], bits, 1)[:, :n].t()  # [N, G]
        if fmt.kind == "gptq":  # v1 stores z - 1 (a stored 2^bits - 1 reads as 2^bits, as
            zero = zero + 1  # AutoGPTQ's kernels read it: z = 0 does not round-trip in v1)
        scale = parts["scales"].float().t()  # [N, G]
        g_idx = parts.get("g_idx")
    if tuple(codes.shape) != (n, k) or scale.shape[0] != n or tuple(zero.shape) != scale.shape:
        raise CheckpointError(
            f"{name}: packed weight {tuple(codes.shape)}, scales {tuple(scale.shape)} and zero "
            f"points {tuple(zero.shape)} do not agree"
        )
    group = fmt.group or k
    if scale.shape[1] * group != k:
        raise CheckpointError(f"{name}: {scale.shape[1]} scales a row for {k} columns in groups "
                              f"of {group}")  # fmt: skip
    perm = _act_order(g_idx, k, group, fmt, name)
    if perm is not None:
        codes = codes[:, perm]  # groups contiguous; group j keeps checkpoint group j
    if fmt.group is None:
        scale, zero = _expand_channel(scale, zero, k, name)
    codes, weight_scale = _scheme_codes(codes, scale, zero, fmt, scheme, name)
    out = {"weight": codes.contiguous(), "weight_scale": weight_scale.contiguous()}
    if perm is not None:
        out["input_perm"] = perm
    return out


def unpack_checkpoint(
    tensors: Iterable[tuple[str, Tensor]], config: QuantConfig
) -> Iterator[tuple[str, Tensor]]:
    """A packed checkpoint's (name, tensor) stream -> the stream the loader fills QuantLinear
    from: each packed linear's parts gathered (a safetensors file keeps them together; they are
    held until the last arrives) and unpacked; every other tensor as it is. A linear with a
    part missing is a CheckpointError naming it."""
    fmt, scheme = config.packing, config.scheme
    parts = _parts(fmt)
    # g_idx: required with act-order; otherwise read when it comes first (safetensors files
    # sort their names: g_idx before qweight) and checked trivial when it comes after.
    optional = set() if fmt.act_order else {"g_idx", "weight_g_idx"}
    pending: dict[str, dict[str, Tensor]] = {}
    done: set[str] = set()
    for name, tensor in tensors:
        prefix, _, part = name.rpartition(".")
        if part not in parts and part not in ("g_idx", "weight_g_idx"):
            yield name, tensor
            continue
        if prefix in done:  # a g_idx after its weight, without act-order
            k = tensor.numel()
            _act_order(tensor, k, fmt.group or k, fmt, prefix)
            continue
        held = pending.setdefault(prefix, {})
        held[part] = tensor
        if all(p in held or p in optional for p in parts):
            unpacked = unpack_linear(pending.pop(prefix), fmt, scheme, prefix)
            done.add(prefix)
            for suffix, value in unpacked.items():
                yield f"{prefix}.{suffix}", value
    for prefix, held in pending.items():
        missing = [p for p in parts if p not in held and p not in optional]
        raise CheckpointError(
            f"the checkpoint is missing tensor(s) of {prefix}: {', '.join(missing)}"
        )


# --------------------------------------------------------------------------- configuration


def _int(section: dict, where: str, *keys: str, default=None):
    for key in keys:
        if key in section:
            return section[key]
    if default is None:
        raise QuantizationError(f"{where} lacks {keys[0]!r}")
    return default


def _scheme(bits: int, group: int | None, symmetric: bool, where: str) -> QuantScheme:
    if bits not in (4, 8):
        raise QuantizationError(f"{where}: {bits}-bit weights are not supported; 4 or 8 bits")
    scheme_group = CHANNEL_GROUP if group is None else group
    weight = {(4, True): "int4", (8, True): "int8", (4, False): "uint4_zp",
              (8, False): "uint8_zp"}[(bits, symmetric)]  # fmt: skip
    try:
        return QuantScheme("group", "none", weight=weight, group=scheme_group)
    except QuantizationError as err:
        raise QuantizationError(f"{where}: {err}") from None


def gptq_config(section: dict) -> QuantConfig:
    where = "quantization_config"
    bits = int(_int(section, where, "bits"))
    group = int(_int(section, where, "group_size", default=-1))
    fmt_name = section.get("checkpoint_format", "gptq")
    if fmt_name not in ("gptq", "gptq_v2"):
        raise QuantizationError(
            f"{where}.checkpoint_format={fmt_name!r} is not supported; 'gptq' or 'gptq_v2'"
        )
    if section.get("dynamic"):
        raise QuantizationError(f"{where}.dynamic (per-module overrides) is not supported")
    if section.get("lm_head"):
        raise QuantizationError(f"{where}.lm_head=true is not supported; lm_head stays float")
    symmetric = bool(section.get("sym", True))
    fmt = PackedFormat(fmt_name, bits, None if group == -1 else group, symmetric,
                       bool(section.get("desc_act", False)))  # fmt: skip
    ignore = tuple(section.get("modules_to_not_convert") or ())
    return QuantConfig("gptq", _scheme(bits, fmt.group, symmetric, where), ignore=ignore,
                       packing=fmt)  # fmt: skip


def awq_config(section: dict) -> QuantConfig:
    where = "quantization_config"
    bits = int(_int(section, where, "bits", "w_bit"))
    group = int(_int(section, where, "group_size", "q_group_size"))
    version = str(section.get("version", "gemm")).lower()
    if version != "gemm":
        raise QuantizationError(
            f"{where}.version={version!r} is not supported; AutoAWQ's 'gemm' packing"
        )
    if bits != 4:
        raise QuantizationError(f"{where}.bits={bits}: AWQ checkpoints are 4-bit here")
    if not section.get("zero_point", True):
        raise QuantizationError(f"{where}.zero_point=false is not supported")
    fmt = PackedFormat("awq", 4, None if group == -1 else group, False, False)
    ignore = tuple(section.get("modules_to_not_convert") or ())
    return QuantConfig("awq", _scheme(4, fmt.group, False, where), ignore=ignore, packing=fmt)


def pack_quantized_config(section: dict, where: str, weights: dict, ignore: tuple) -> QuantConfig:
    """A compressed-tensors "pack-quantized" group's weights (W4A16 / W8A16)."""
    where = f"{where}.weights"
    if weights.get("type") != "int" or weights.get("dynamic"):
        raise QuantizationError(f"{where}: want static int weights, got type "
                                f"{weights.get('type')!r}")  # fmt: skip
    bits = int(weights.get("num_bits", 0))
    strategy = weights.get("strategy")
    if strategy == "group":
        group = int(weights.get("group_size") or 0)
    elif strategy == "channel":
        group = None
    else:
        raise QuantizationError(f"{where}.strategy={strategy!r}: 'group' or 'channel'")
    actorder = weights.get("actorder")
    if actorder not in (None, "group", "weight", "static", False):
        raise QuantizationError(f"{where}.actorder={actorder!r} is not supported")
    symmetric = weights.get("symmetric", True) is not False
    # actorder "group" saves weight_g_idx; "weight" / "static" keep groups contiguous.
    fmt = PackedFormat("pack-quantized", bits, group, symmetric, actorder == "group")
    scheme = _scheme(bits, group, symmetric, where)
    return QuantConfig("compressed-tensors", scheme, ignore=ignore, packing=fmt)


# --------------------------------------------------------------------------- writing


def quantize_groups(
    w: Tensor,
    bits: int,
    group: int,
    symmetric: bool,
    perm: Tensor | None = None,
    min_zero: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A float weight [N, K] -> (codes [N, K] 0 .. 2^bits - 1, scales [N, G] float16, zero
    points [N, G] int, g_idx [K]) as GPTQ quantizes: round-to-nearest per group, the scale
    rounded to float16 first. `perm` (act-order): group j holds columns perm[j g .. j g + g).
    min_zero: the smallest zero point the format stores (1 for GPTQ v1, which stores z - 1)."""
    n, k = w.shape
    perm = torch.arange(k, device=w.device) if perm is None else perm.to(w.device)
    maxq = (1 << bits) - 1
    wp = w.float()[:, perm].reshape(n, k // group, group)  # [N, G, g]
    lo, hi = wp.amin(-1).clamp(max=0), wp.amax(-1).clamp(min=0)
    if symmetric:
        top = torch.maximum(lo.abs(), hi)
        scale = (2 * top / maxq).clamp_min(1e-8).half()
        zero = torch.full_like(scale, 1 << (bits - 1), dtype=torch.int32)
    else:
        scale = ((hi - lo) / maxq).clamp_min(1e-8).half()
        zero = torch.round(-lo / scale.float()).clamp(min_zero, maxq).to(torch.int32)
    q = torch.round(wp / scale.float()[..., None]) + zero[..., None]
    qp = q.clamp(0, maxq).to(torch.int32).reshape(n, k)
    codes = torch.empty_like(qp)
    codes[:, perm] = qp
    g_idx = torch.empty(k, dtype=torch.int32, device=w.device)
    g_idx[perm] = (torch.arange(k, device=w.device) // group).to(torch.int32)
    return codes, scale, zero, g_idx


def pack_linear(w: Tensor, fmt: PackedFormat, perm: Tensor | None = None) -> dict[str, Tensor]:
    """A float weight [N, K] in `fmt`'s tensors (by part name): what a checkpoint holds."""
    n, k = w.shape
    group = fmt.group or k
    min_zero = 1 if fmt.kind == "gptq" else 0
    codes, scale, zero, g_idx = quantize_groups(w, fmt.bits, group, fmt.symmetric, perm, min_zero)
    bits = fmt.bits
    if fmt.kind == "pack-quantized":
        shape = torch.tensor([n, k], dtype=torch.int32, device=w.device)
        out = {"weight_packed": pack_int32(codes, bits, 1),
               "weight_scale": scale.to(torch.bfloat16), "weight_shape": shape}  # fmt: skip
        if not fmt.symmetric:
            out["weight_zero_point"] = pack_int32(zero, bits, 0)
        if fmt.act_order:
            out["weight_g_idx"] = g_idx
        return out
    if fmt.kind == "awq":
        order = torch.tensor(AWQ_ORDER, device=w.device)
        q = codes.t().reshape(k, -1, 8)[:, :, order].reshape(k, n)  # [K, N], AWQ's order
        z = zero.t().reshape(zero.shape[1], -1, 8)[:, :, order].reshape(zero.shape[1], n)
        return {"qweight": pack_int32(q, 4, 1), "qzeros": pack_int32(z, 4, 1),
                "scales": scale.t().contiguous()}  # fmt: skip
    stored = zero - 1 if fmt.kind == "gptq" else zero  # v1 stores z - 1
    stored = stored & ((1 << bits) - 1)
    return {
        "qweight": pack_int32(codes.t(), bits, 0),
        "qzeros": pack_int32(stored.t(), bits, 1),
        "scales": scale.t().contiguous(),
        "g_idx": g_idx,
    }


def quantize_checkpoint_linear(
    name: str, tensor: Tensor, fmt: PackedFormat, perm: Tensor | None = None
) -> dict[str, Tensor]:
    """One checkpoint tensor as `fmt` stores it: a decoder projection's weight packed, anything
    else as it is."""
    if not is_quantized_checkpoint_weight(name):
        return {name: tensor}
    prefix = name.removesuffix(".weight")
    return {f"{prefix}.{part}": t for part, t in pack_linear(tensor, fmt, perm).items()}


# `bench make-model --quantize` names -> the format it writes (group 128, symmetric, no
# act-order, as the common GPTQ / AWQ / llm-compressor W4A16 releases).
PACKED_LAYOUTS = {
    "gptq-int4": PackedFormat("gptq", 4, 128, True, False),
    "gptq-int8": PackedFormat("gptq", 8, 128, True, False),
    "awq-int4": PackedFormat("awq", 4, 128, False, False),
    "ct-w4a16": PackedFormat("pack-quantized", 4, 128, True, False),
    "ct-w8a16": PackedFormat("pack-quantized", 8, 128, True, False),
}


def packed_quantization_config(fmt: PackedFormat) -> dict:
    """The config.json `quantization_config` of a checkpoint written in `fmt`."""
    group = fmt.group or -1
    if fmt.kind.startswith("gptq"):
        return {"quant_method": "gptq", "bits": fmt.bits, "group_size": group,
                "desc_act": fmt.act_order, "sym": fmt.symmetric, "lm_head": False,
                "checkpoint_format": fmt.kind}  # fmt: skip
    if fmt.kind == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                "version": "gemm"}  # fmt: skip
    weights = {"num_bits": fmt.bits, "type": "int", "symmetric": fmt.symmetric,
               "dynamic": False, "strategy": "group" if fmt.group else "channel",
               "group_size": fmt.group, "actorder": "group" if fmt.act_order else None}  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}
        },
        "ignore": ["lm_head"],
    }
