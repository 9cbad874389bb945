"""GPTQ, AWQ and compressed-tensors pack-quantized checkpoints (issue 29, models/quant_formats):
each layout written from known float weights, read by our loader, and checked against an
independent dequantization written here from the formats' own descriptions (bit by bit, numpy,
per element) and against the weights it came from; a tiny Llama in each format against its
dequantized float32 twin; the errors. Tiny shapes, no compile."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from fp8_models import make_tiny_llama
from int_models import independent_dequantize, write_packed, write_twin
from safetensors.torch import load_file, save_file
from test_quant import logits_of

from compile_engine.models.errors import CheckpointError
from compile_engine.models.loader import load_model
from compile_engine.models.quant import (
    PackedFormat,
    QuantConfig,
    QuantizationError,
    QuantLinear,
    dequantize_int_ref,
    quant_config,
    quant_linear_ref,
)
from compile_engine.models.quant_formats import (
    pack_int32,
    pack_linear,
    packed_quantization_config,
    unpack_checkpoint,
    unpack_int32,
)

FORMATS = {
    "gptq-sym4": PackedFormat("gptq", 4, 32, True, False),
    "gptq-asym4-actorder": PackedFormat("gptq", 4, 64, False, True),
    "gptq_v2-asym4": PackedFormat("gptq_v2", 4, 128, False, False),
    "gptq-sym8-actorder": PackedFormat("gptq", 8, 32, True, True),
    "gptq_v2-asym8-channel": PackedFormat("gptq_v2", 8, None, False, False),
    "awq-4": PackedFormat("awq", 4, 32, False, False),
    "awq-4-g128": PackedFormat("awq", 4, 128, False, False),
    "ct-w4-sym": PackedFormat("pack-quantized", 4, 128, True, False),
    "ct-w4-asym-actorder": PackedFormat("pack-quantized", 4, 32, False, True),
    "ct-w8-channel": PackedFormat("pack-quantized", 8, None, True, False),
}


def test_int32_fields_round_trip() -> None:
    for bits in (4, 8):
        for dim in (0, 1):
            values = torch.randint(0, 1 << bits, (16, 24), dtype=torch.int32)
            words = pack_int32(values, bits, dim)
            assert words.dtype == torch.int32
            assert torch.equal(unpack_int32(words, bits, dim), values)
    words = pack_int32(torch.tensor([[15] * 8]), 4, 1)
    assert words.item() == -1  # all ones: the sign bit set, two's complement


@pytest.mark.parametrize("name", FORMATS)
def test_layout_unpacks_to_its_independent_dequantization(name: str) -> None:
    fmt = FORMATS[name]
    n, k = 48, 256 if fmt.group in (None, 128) else 128
    torch.manual_seed(1)
    w = torch.randn(n, k) * 0.05
    perm = torch.randperm(k) if fmt.act_order else None
    parts = pack_linear(w, fmt, perm)
    want = independent_dequantize(parts, fmt)
    # the writer quantized w: every element within half a step of its group's scale
    step = 0.05 * 8 / ((1 << fmt.bits) - 1)
    assert np.abs(want - w.numpy()).max() <= step
    config = quant_config({"quantization_config": packed_quantization_config(fmt)}, None)
    assert config.packing == fmt
    prefix = "model.layers.0.mlp.down_proj"
    stream = [(f"{prefix}.{p}", t) for p, t in parts.items()]
    got = dict(unpack_checkpoint(stream, config))
    layer = QuantLinear(k, n, config.scheme, bias=False, dtype=torch.float32,
                        act_order=fmt.act_order)  # fmt: skip
    for part, tensor in got.items():
        param = getattr(layer, part.rpartition(".")[2])
        layer.load_shard(param, tensor, None, part)
    order = layer.input_perm if fmt.act_order else torch.arange(k)
    # the loaded weight, in its stored column order, is the format's bit for bit
    stored = dequantize_int_ref(layer.weight, layer.weight_scale, config.scheme)
    assert torch.equal(stored, torch.from_numpy(want)[:, order])
    x = torch.randn(3, k)
    out = layer(x)
    torch.testing.assert_close(out, x @ torch.from_numpy(want).t(), rtol=1e-5, atol=1e-5)
    ref = quant_linear_ref(x[:, order], layer.weight, layer.weight_scale, None, None,
                           layer.scheme)  # fmt: skip
    assert torch.equal(out, ref)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("llama-fp32"))


@pytest.mark.parametrize("name", ["gptq-sym4", "gptq-asym-actorder", "awq", "ct-w8-sym"])
def test_tiny_llama_in_each_format_matches_its_twin(name: str, tiny: Path, tmp_path: Path):
    fmt = {
        "gptq-sym4": PackedFormat("gptq", 4, 32, True, False),
        "gptq-asym-actorder": PackedFormat("gptq", 4, 32, False, True),
        "awq": PackedFormat("awq", 4, 32, False, False),
        "ct-w8-sym": PackedFormat("pack-quantized", 8, 32, True, False),
    }[name]
    packed = write_packed(tiny, tmp_path / "packed", fmt)
    twin = write_twin(packed, tiny, tmp_path / "twin", fmt)
    loaded = load_model(packed)
    layers = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * 2 and loaded.quant.packing == fmt
    assert (layers[0].input_perm is not None) == fmt.act_order
    assert loaded.quant.describe()["packing"]["kind"] == fmt.kind
    got, want = logits_of(loaded.model), logits_of(load_model(twin).model)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_errors_name_the_field(tiny: Path, tmp_path: Path) -> None:
    base = packed_quantization_config(PackedFormat("gptq", 4, 32, True, False))
    for change, match in (
        ({"bits": 3}, "3-bit"),
        ({"group_size": 48}, "group"),
        ({"checkpoint_format": "marlin"}, "checkpoint_format"),
        ({"lm_head": True}, "lm_head"),
    ):
        with pytest.raises(QuantizationError, match=match):
            quant_config({"quantization_config": {**base, **change}}, None)
    awq = packed_quantization_config(PackedFormat("awq", 4, 32, False, False))
    with pytest.raises(QuantizationError, match="version"):
        quant_config({"quantization_config": {**awq, "version": "gemv"}}, None)
    with pytest.raises(QuantizationError, match="quant_method='bitsandbytes'"):
        quant_config({"quantization_config": {"quant_method": "bitsandbytes"}}, None)
    # a missing part, and act-order shards of one fused layer in different orders
    fmt = PackedFormat("gptq", 4, 32, False, True)
    packed = write_packed(tiny, tmp_path / "packed", fmt)
    tensors = load_file(str(packed / "model.safetensors"))
    config: QuantConfig = quant_config(json.loads((packed / "config.json").read_text()), None)
    partial = [(n, t) for n, t in tensors.items() if not n.endswith("0.self_attn.k_proj.qzeros")]
    with pytest.raises(CheckpointError, match="k_proj: qzeros"):
        list(unpack_checkpoint(partial, config))
    k = tensors["model.layers.0.self_attn.k_proj.g_idx"]
    tensors["model.layers.0.self_attn.k_proj.g_idx"] = k.flip(0)
    save_file(tensors, str(packed / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="different g_idx"):
        load_model(packed)


def test_make_model_writes_gptq_and_awq_that_load(tmp_path: Path) -> None:
    from compile_engine.benchmarks.make_model import make_model

    # tiny-llama is 64 wide: groups of 64 (llama3-8b: 128)
    cases = (("gptq-int4", "int4:group64:none"), ("awq-int4", "uint4_zp:group64:none"),
             ("gptq-int8", "int8:group64:none"))  # fmt: skip
    for layout, scheme in cases:
        out = make_model("tiny-llama", tmp_path / layout, quantize=layout)
        loaded = load_model(out)
        assert str(loaded.quant.scheme) == scheme
        assert torch.isfinite(logits_of(loaded.model)).all()
