"""FP8 quantization on CPU: the quant ops' references, the scheme, every checkpoint layout
loaded and compared with its dequantized float32 twin, online FP8 against HF, and the errors.

Tiny shapes only (the tiny Llama of tests/tiny_models, block scales of 16 x 16 so that its
projections hold several blocks); no Inductor compile here (tests/passes/ has the pass's).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fp8_models import BLOCK, make_tiny_llama, scheme_of, write_fp8
from safetensors.torch import load_file, save_file

from compile_engine.models.loader import load_model
from compile_engine.models.quant import (
    CHECKPOINT_LAYOUTS,
    FP8_DTYPE,
    QuantizationError,
    QuantLinear,
    QuantScheme,
    checkpoint_quantization_config,
    dequantize_fp8_ref,
    quant_config,
    quant_linear_ref,
    quantize_checkpoint_tensor,
    quantize_fp8_ref,
)

from paged_harness import PagedHarness, run_schedule

SEQUENCES = [[5, 17, 3, 44, 9, 61, 2, 8, 30, 11, 7], [12, 40, 6, 33, 90, 4]]


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def logits_of(model) -> torch.Tensor:
    harness = PagedHarness(model, block_size=4, num_blocks=32)
    return torch.cat(run_schedule(harness, SEQUENCES, prefill_chunk=4, decode_tail=2))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("llama-fp32"))


# --------------------------------------------------------------------------- ops


def test_scheme_string_round_trip_and_errors():
    for scheme in (
        QuantScheme("tensor", "tensor"),
        QuantScheme("channel", "token"),
        QuantScheme("block", "none", (128, 128)),
    ):
        assert QuantScheme.parse(str(scheme)) == scheme
    assert str(QuantScheme("block", "none", (128, 64))) == "fp8_e4m3:block128x64:none"
    with pytest.raises(QuantizationError, match="activation"):
        QuantScheme("channel", "group")
    with pytest.raises(QuantizationError, match="block size"):
        QuantScheme("channel", "none", (128, 128))


def test_quantize_per_token_and_static():
    x = torch.randn(5, 40) * torch.arange(1, 6)[:, None]
    q, scale = quantize_fp8_ref(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (5, 1)
    assert torch.equal(q.float().abs().amax(-1), torch.full((5,), 448.0))  # each row's amax
    assert ((q.float() * scale - x).abs() <= x.abs() * 2**-3 + 1e-6).all()  # e4m3: 3 bits
    assert torch.equal(quantize_fp8_ref(torch.zeros(2, 8))[0].float(), torch.zeros(2, 8))
    q, scale = quantize_fp8_ref(torch.tensor([[1.0, -100.0]]), torch.tensor(0.01))
    assert q.float().tolist() == [[96.0, -448.0]] and scale.item() == pytest.approx(0.01)
    # The op equals its reference.
    q_op, s_op = torch.ops.ce.quantize_fp8(x, None)
    q_ref, s_ref = quantize_fp8_ref(x)
    assert torch.equal(q_op.float(), q_ref.float()) and torch.equal(s_op, s_ref)


@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
def test_quant_linear_reference_is_dequantize_then_matmul(kind):
    torch.manual_seed(0)
    w = torch.randn(48, 40)
    layout = {"tensor": "ct-tensor", "channel": "ct-channel", "block": "ct-block"}[kind]
    parts = quantize_checkpoint_tensor("model.layers.0.mlp.down_proj.weight", w, layout, BLOCK)
    q = parts["model.layers.0.mlp.down_proj.weight"]
    scale = parts["model.layers.0.mlp.down_proj.weight_scale"]
    scheme = QuantScheme(kind, "none", BLOCK if kind == "block" else None)
    if kind == "channel":
        scale = scale.reshape(-1)
    if kind == "tensor":
        scale = scale.reshape(())
    deq = dequantize_fp8_ref(q, scale, str(scheme), torch.float32)
    assert (deq - w).abs().max() <= w.abs().max() * 2**-3  # within e4m3's rounding
    x = torch.randn(3, 40)
    want = F.linear(x, deq)
    got = torch.ops.ce.quant_linear(x, q, scale, None, None, str(scheme))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # W8A8 per token: the activation's rounding on top, close but not equal.
    act = str(QuantScheme(kind, "token", scheme.block))
    w8a8 = quant_linear_ref(x, q, scale, None, None, act)
    assert cosine(w8a8, want) > 0.998 and not torch.equal(w8a8, want)
    assert torch.ops.ce.dequantize_fp8(q, scale, str(scheme), torch.float32).equal(deq)


# --------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("layout", CHECKPOINT_LAYOUTS)
def test_fp8_checkpoint_layout_matches_its_dequantized_twin(layout, tiny, tmp_path):
    fp8_dir, twin_dir = write_fp8(tiny, tmp_path, layout)
    loaded = load_model(fp8_dir)
    quantized = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == 4 * 2  # qkv, o_proj, gate_up, down of 2 layers
    assert loaded.quant.scheme == scheme_of(layout)
    assert loaded.model.lm_head.weight.dtype == torch.float32  # lm_head stays unquantized
    got = logits_of(loaded.model)
    want = logits_of(load_model(twin_dir).model)
    scheme = loaded.quant.scheme
    if scheme.activation == "none":
        # W8A16 over the same FP8 weights: the twin computes the same products.
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    else:
        # Activations rounded to FP8 (and a fused per-tensor weight requantized to its largest
        # shard scale): close, as the issue bounds it.
        assert cosine(got, want) >= 0.999
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_quant_linear_count(tiny, tmp_path):
    loaded = load_model(write_fp8(tiny, tmp_path, "ct-channel")[0])
    names = [n for n, m in loaded.model.named_modules() if isinstance(m, QuantLinear)]
    assert names == [
        f"model.layers.{i}.{p}"
        for i in range(2)
        for p in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    ]


def test_online_fp8_against_hf(tiny):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny)).eval()
    loaded = load_model(tiny, quantization="fp8")
    assert (
        loaded.quant.method == "online-fp8" and str(loaded.quant.scheme) == "fp8_e4m3:channel:token"
    )
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8_DTYPE and qkv.scale.shape == (qkv.out_features,)
    ours = torch.cat(run_schedule(PagedHarness(loaded.model, 4, 32), [SEQUENCES[0]], 4, 2))
    with torch.no_grad():
        theirs = hf(torch.tensor([SEQUENCES[0]])).logits[0]
    assert cosine(ours, theirs) >= 0.999


def test_errors_name_the_field(tiny, tmp_path):
    def config_with(section: dict) -> dict:
        return {"quantization_config": section}

    with pytest.raises(QuantizationError, match="quant_method='bitsandbytes'"):
        quant_config(config_with({"quant_method": "bitsandbytes"}), None)
    with pytest.raises(QuantizationError, match="quant_algo='NVFP4' is not supported"):
        quant_config(config_with({"quant_method": "modelopt", "quant_algo": "NVFP4"}), None)
    with pytest.raises(QuantizationError, match="kv_cache_quant_algo='INT8'"):
        section = {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "INT8"}
        quant_config(config_with(section), None)
    with pytest.raises(QuantizationError, match="quantization='int8'"):
        quant_config({}, "int8")
    section = checkpoint_quantization_config("ct-channel")
    section["config_groups"]["group_0"]["weights"]["strategy"] = "group"
    with pytest.raises(QuantizationError, match=r"weights.strategy='group'"):
        quant_config(config_with(section), None)
    section = checkpoint_quantization_config("ct-channel")
    section["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    with pytest.raises(QuantizationError, match="8-bit float"):
        quant_config(config_with(section), None)
    # A model-dtype weight in an FP8 checkpoint.
    fp8_dir, _ = write_fp8(tiny, tmp_path, "ct-channel")
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = tensors[name].float()
    save_file(tensors, str(fp8_dir / "model.safetensors"))
    with pytest.raises(Exception, match="float8_e4m3fn"):
        load_model(fp8_dir)


def test_moe_is_refused(tmp_path):
    from tiny_moe import make_tiny_moe

    make_tiny_moe("mixtral", tmp_path)
    with pytest.raises(QuantizationError, match="MixtralForCausalLM is not supported"):
        load_model(tmp_path, quantization="fp8")


def test_make_model_writes_an_fp8_checkpoint_that_loads(tmp_path):
    from compile_engine.benchmarks.make_model import make_model

    out = make_model("tiny-llama", tmp_path / "fp8", quantize="ct-channel")
    loaded = load_model(out)
    assert loaded.quant.method == "compressed-tensors"
    assert str(loaded.quant.scheme) == "fp8_e4m3:channel:token"
    down = loaded.model.model.layers[1].mlp.down_proj
    assert down.weight.dtype == FP8_DTYPE and down.scale.shape == (down.out_features,)
    assert torch.isfinite(logits_of(loaded.model)).all()


# --------------------------------------------------------------------------- ModelOpt FP8


def test_modelopt_checkpoint_loads_by_either_config_file(tiny, tmp_path):
    # config.json's quantization_config (newer exports), or hf_quant_config.json alone (older
    # ones): per-tensor weights and static input scales as 0-d tensors, k_proj.k_scale and
    # v_proj.v_scale into the attention layers, exclude_modules wildcards honoured.
    fp8_dir, twin_dir = write_fp8(tiny, tmp_path, "modelopt-fp8")
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale"].shape == ()
    assert tensors["model.layers.1.self_attn.k_proj.k_scale"].shape == ()
    tensors["model.layers.1.self_attn.v_proj.v_scale"] = torch.tensor(0.125)
    save_file(tensors, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    loaded = load_model(fp8_dir, kv_cache_dtype="fp8")
    assert (
        loaded.quant.method == "modelopt" and str(loaded.quant.scheme) == "fp8_e4m3:tensor:tensor"
    )
    assert float(loaded.model.model.layers[1].self_attn.v_scale) == 0.125
    assert float(loaded.model.model.layers[1].self_attn.k_scale) == 1.0
    config = json.loads((fp8_dir / "config.json").read_text())
    section = config.pop("quantization_config")
    section.pop("quant_method")
    section["exclude_modules"] = ["lm_head", "model.layers.1.mlp.*"]
    (fp8_dir / "config.json").write_text(json.dumps(config))
    hf_quant = {"producer": {"name": "modelopt", "version": "0.29"}, "quantization": section}
    (fp8_dir / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    for proj in ("gate_proj", "up_proj", "down_proj"):  # excluded: stored in the model dtype
        prefix = f"model.layers.1.mlp.{proj}"
        for suffix in ("weight_scale", "input_scale"):
            tensors.pop(f"{prefix}.{suffix}")
        tensors[f"{prefix}.weight"] = load_file(str(twin_dir / "model.safetensors"))[
            f"{prefix}.weight"
        ]
    save_file(tensors, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    loaded = load_model(fp8_dir)
    assert loaded.quant.method == "modelopt"
    assert not isinstance(loaded.model.model.layers[1].mlp.down_proj, QuantLinear)
    assert isinstance(loaded.model.model.layers[0].mlp.down_proj, QuantLinear)


def _dequantized_twin(fp8_dir: Path, out: Path) -> Path:
    """fp8_dir's checkpoint with every FP8 weight times its per-tensor scale, in float32, and
    no scales: the reference an FP8 checkpoint is compared with."""
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    twin = {}
    for name, t in tensors.items():
        if name.endswith(("_scale", ".k_scale", ".v_scale")):
            continue
        if t.dtype == FP8_DTYPE:
            t = t.float() * tensors[name.removesuffix("weight") + "weight_scale"].float()
        twin[name] = t
    out.mkdir()
    save_file(twin, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_modelopt_make_model_greedy_generates_as_its_twin(tmp_path):
    from compile_engine.benchmarks.make_model import make_model
    from compile_engine.runtime.llm import LLM
    from compile_engine.runtime.sampling_params import SamplingParams

    out = make_model("tiny-llama", tmp_path / "modelopt", quantize="modelopt-fp8")
    section = json.loads((out / "config.json").read_text())["quantization_config"]
    assert section["quant_method"] == "modelopt" and section["quant_algo"] == "FP8"
    twin = _dequantized_twin(out, tmp_path / "twin")
    # Teacher-forced (the harness): logits close, argmax mostly equal.
    got_logits, want_logits = logits_of(load_model(out).model), logits_of(load_model(twin).model)
    assert cosine(got_logits, want_logits) >= 0.999
    assert (got_logits.argmax(-1) == want_logits.argmax(-1)).float().mean() >= 0.9
    params = SamplingParams(temperature=0, max_tokens=8)
    runs = []
    for model, kv in ((out, "fp8"), (twin, "auto")):
        llm = LLM(str(model), dtype="float32", target="cpu", enforce_eager=True,
                  num_kv_blocks=64, kv_cache_dtype=kv)  # fmt: skip
        runs.append(
            [o.outputs[0].token_ids for o in llm.generate([list(s) for s in SEQUENCES], params)]
        )
    assert llm.engine.loaded.quant is None
    # Free-running over random weights, whose near-flat logits let one flip change the rest:
    # each prompt's first token equal, every request run to its length.
    got, want = runs
    assert [g[0] for g in got] == [w[0] for w in want], (got, want)
    assert all(len(g) == 8 for g in got)
