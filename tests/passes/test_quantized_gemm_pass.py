"""quantized_gemm: every quant_linear of an FP8 model, to fp8_linear on h100 in half precision
and to its reference on cpu; numerics unchanged on cpu (eager pieces and one Inductor build
through LLM); on the GPU (gpu marker) an FP8 engine's greedy tokens against its reference."""

from __future__ import annotations

import pytest
import torch
from fp8_models import make_tiny_llama, write_fp8

from compile_engine.models.ops import silu_and_mul_ref
from compile_engine.models.quant import quant_linear_ref
from compile_engine.passes.base import PassContext
from compile_engine.passes.registry import select

from oracle import assert_greedy_near_ties
from pass_kit import apply_pass, assert_numerics_unchanged, capture_graph, count_matches, targets_of

LAYERS, LINEARS = 2, 4  # the tiny Llama: qkv_proj, o_proj, gate_up_proj, down_proj a layer
PROMPTS = [[5, 17, 3, 44, 9, 61, 2, 8], [12, 40, 6], [7] * 20]


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return write_fp8(make_tiny_llama(root / "src"), root, "ct-channel")[0]


@pytest.fixture(scope="module")
def graph(fp8_dir):
    return capture_graph(model_dir=fp8_dir)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_quant_linear_on_h100(graph, dtype):
    import compile_engine.kernels_generated.fp8_linear  # noqa: F401  (the op)

    ctx = PassContext("h100", dtype)
    assert count_matches("quantized_gemm", graph, ctx) == LINEARS * LAYERS
    gm = apply_pass("quantized_gemm", graph, ctx)
    targets = targets_of(gm)
    assert torch.ops.ce.quant_linear.default not in targets
    kernel = torch.ops.ce_kernels.fp8_linear.default
    assert targets.count(kernel) == LINEARS * LAYERS
    # ct-channel quantizes the activation per token: a quantize node before every GEMM, whose
    # output it takes with the model dtype and the kernel config's key; down_proj's silu_and_mul
    # lowered to its reference, so that Inductor fuses the quantization into it.
    assert targets.count(torch.ops.ce.quantize_fp8.default) == LINEARS * LAYERS
    assert targets.count(silu_and_mul_ref) == LAYERS
    assert torch.ops.ce.silu_and_mul.default not in targets
    calls = [n for n in gm.graph.nodes if n.target is kernel]
    assert all(n.args[6] == dtype and n.args[7] == ctx.kernel.key for n in calls)
    # After lower_to_reference no ce op but attention is left for Inductor.
    lowered = apply_pass("lower_to_reference", gm, ctx)
    assert torch.ops.ce.quantize_fp8.default not in targets_of(lowered)
    # Nothing else claims them: the bf16 GEMM passes see no F.linear in the decoder.
    assert count_matches("skinny_gemm", graph, ctx) == 0


def test_reference_on_cpu_and_not_in_float32_on_h100(graph):
    ctx = PassContext("cpu", torch.float32)
    targets = targets_of(apply_pass("quantized_gemm", graph, ctx))
    assert targets.count(quant_linear_ref) == LINEARS * LAYERS
    assert count_matches("quantized_gemm", graph, PassContext("h100", torch.float32)) == 0


def test_in_the_pipeline_by_default():
    chosen = [p.name for p in select(None)]
    assert chosen.index("quantized_gemm") < chosen.index("lower_to_reference")
    assert "quantized_gemm" not in [p.name for p in select("-quantized_gemm")]


def test_numerics_unchanged_on_cpu(fp8_dir):
    result = assert_numerics_unchanged("quantized_gemm", fp8_dir, rtol=1e-5)
    assert result["matches"] == LINEARS * LAYERS


def _greedy(llm, max_tokens: int = 6) -> list[list[int]]:
    from compile_engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.slow
def test_compiled_cpu_engine_generates_as_the_reference(fp8_dir):
    # The one Inductor build of this file: the reference lowered into the graph compiles and
    # greedy-decodes the tokens the eager reference does.
    from compile_engine import LLM

    eager = _greedy(LLM(str(fp8_dir), target="cpu", enforce_eager=True, num_kv_blocks=64))
    # The pieces, where the pass lowers every linear; the CPU decode graph (which would double
    # the cold compile) runs the same lowered linears.
    compiled = _greedy(
        LLM(str(fp8_dir), target="cpu", num_kv_blocks=64, passes="-paged_attention_cpu")
    )
    assert compiled == eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["ct-channel", "ct-tensor", "fp8-block", "online"])
def test_h100_engine_agrees_with_the_reference(tmp_path, layout):
    from compile_engine import LLM

    src = make_tiny_llama(tmp_path / "src", torch.bfloat16)
    if layout == "online":
        model, quantization = src, "fp8"
    else:
        model, quantization = write_fp8(src, tmp_path, layout)[0], None
    kwargs = dict(dtype="bfloat16", num_kv_blocks=64, quantization=quantization)
    eager = LLM(str(model), target="h100", enforce_eager=True, **kwargs)  # the reference ops
    graphed = LLM(str(model), target="h100", max_num_seqs=4, max_num_batched_tokens=64, **kwargs)
    assert graphed.engine.compiled.pass_manager.match_counts["quantized_gemm"] == 8
    _assert_follows(graphed, eager)


def _assert_follows(llm, reference) -> None:
    """llm's greedy tokens follow the reference engine's but where it nearly tied (random
    weights: logits within hundredths of a nat; another kernel's accumulation order flips
    those), and most of them equal."""
    from compile_engine import SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=4)
    want = [o.outputs[0] for o in reference.generate(PROMPTS, params)]
    tokens = _greedy(llm, max_tokens=16)
    assert_greedy_near_ties(tokens, want, max_gap=0.02, min_equal=0.5)


# --------------------------------------------------------------------------- integer weights


@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory):
    from int_models import write_packed

    from compile_engine.models.quant import PackedFormat

    root = tmp_path_factory.mktemp("gptq")
    fmt = PackedFormat("gptq", 4, 32, False, True)  # asymmetric, act-order
    return write_packed(make_tiny_llama(root / "src"), root / "gptq", fmt)


def test_integer_weights_lower_to_int_linear_on_h100(gptq_dir):
    import compile_engine.kernels_generated.int_linear  # noqa: F401  (the op)

    graph = capture_graph(model_dir=gptq_dir)
    ctx = PassContext("h100", torch.bfloat16)
    gm = apply_pass("quantized_gemm", graph, ctx)
    targets = targets_of(gm)
    kernel = torch.ops.ce_kernels.int_linear.default
    assert targets.count(kernel) == LINEARS * LAYERS
    assert torch.ops.ce.quant_linear.default not in targets
    assert torch.ops.ce_kernels.fp8_linear.default not in targets
    calls = [n for n in gm.graph.nodes if n.target is kernel]
    assert all(n.args[4].startswith("uint4_zp:group32") and n.args[5] == ctx.kernel.key
               for n in calls)  # fmt: skip
    # cpu: the reference (plain layout; the ATen int4 GEMM takes GGUF's int4pack_cpu only)
    cpu = targets_of(apply_pass("quantized_gemm", graph, PassContext("cpu", torch.float32)))
    assert cpu.count(quant_linear_ref) == LINEARS * LAYERS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["gptq-int4", "awq-int4", "gptq-int8"])
def test_h100_integer_engine_agrees_with_the_reference(tmp_path, layout):
    from compile_engine import LLM
    from compile_engine.benchmarks.make_model import make_model

    model = make_model("tiny-llama", tmp_path / layout, quantize=layout)
    kwargs = dict(dtype="bfloat16", num_kv_blocks=64)
    eager = LLM(str(model), target="h100", enforce_eager=True, **kwargs)
    graphed = LLM(str(model), target="h100", max_num_seqs=4, max_num_batched_tokens=64, **kwargs)
    assert graphed.engine.compiled.pass_manager.match_counts["quantized_gemm"] == 8
    _assert_follows(graphed, eager)
