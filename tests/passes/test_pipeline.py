"""passes/pipeline.py: every registered pass once, the order's constraints, and select() and the
registry following the list rather than the order in which pass files were imported."""

from __future__ import annotations

import pytest

from compile_engine.passes import registry
from compile_engine.passes.pipeline import ORDER, PIPELINE
from compile_engine.passes.registry import REGISTRY, PipelineError, load_all, select

# (earlier, later, why): whichever pass runs first claims the nodes both match.
BEFORE = (
    ("add_rms_norm_into_gemm", "rms_norm_triton", "it fuses the norm into the GEMM"),
    ("add_rms_norm_into_gemm", "skinny_gemm", "it fuses the linear"),
    ("add_rms_norm_into_gemm", "silu_and_mul_triton", "it fuses gate_up's activation"),
    ("add_rms_norm_into_gemm", "silu_and_mul_helion", "it fuses gate_up's activation"),
    ("rotary_into_attention", "paged_attention_triton", "it fuses the attention"),
    ("rotary_into_attention", "rotary_triton", "it fuses the rotary"),
    ("moe_grouped_gemm", "silu_and_mul_triton", "it fuses the MoE chain's activation"),
    ("moe_grouped_gemm", "silu_and_mul_helion", "it fuses the MoE chain's activation"),
    ("silu_and_mul_helion", "silu_and_mul_triton", "with both selected, Helion wins"),
    ("quantized_gemm", "silu_and_mul_triton", "it lowers an FP8 linear's silu_and_mul"),
    ("quantized_gemm", "silu_and_mul_helion", "it lowers an FP8 linear's silu_and_mul"),
)


def test_every_registered_pass_is_listed_once():
    load_all()
    assert len(ORDER) == len(set(ORDER))
    assert sorted(REGISTRY) == sorted(ORDER)
    assert all(why for _, why in PIPELINE)


@pytest.mark.parametrize(("earlier", "later", "why"), BEFORE)
def test_constraint(earlier, later, why):
    assert ORDER.index(earlier) < ORDER.index(later), f"{earlier} before {later}: {why}"


def test_lower_to_reference_is_last():
    assert ORDER[-1] == "lower_to_reference"
    assert select("skinny_gemm")[-1].name == "lower_to_reference"
    assert [p.name for p in select("-lower_to_reference")][-1] == "lower_to_reference"


def test_select_returns_pipeline_order_whatever_the_spec_order():
    chosen = select("skinny_gemm,rms_norm_triton,add_rms_norm_into_gemm")
    assert [p.name for p in chosen] == [
        "add_rms_norm_into_gemm",
        "rms_norm_triton",
        "skinny_gemm",
        "lower_to_reference",
    ]
    defaults = [p.name for p in select(None)]
    assert defaults == [n for n in ORDER if REGISTRY[n].default_on or n == "lower_to_reference"]


def test_registration_order_does_not_matter():
    """What a renamed pass file changes is the order of the imports, hence of registration."""
    load_all()
    saved = dict(REGISTRY)
    try:
        shuffled = dict(reversed(saved.items()))
        REGISTRY.clear()
        REGISTRY.update(shuffled)
        load_all()
        assert list(REGISTRY) == list(ORDER)
    finally:
        REGISTRY.clear()
        REGISTRY.update(saved)


@pytest.mark.parametrize(
    "order",
    [ORDER[:-1], (*ORDER, ORDER[0]), (*ORDER, "no_such_pass")],
    ids=["missing", "twice", "unregistered"],
)
def test_a_pipeline_that_disagrees_with_the_registry_is_refused(monkeypatch, order):
    monkeypatch.setattr(registry, "ORDER", order)
    with pytest.raises(PipelineError, match="exactly once"):
        load_all()


def test_pass_manager_uuid_covers_the_kernel_config():
    # The artifact's cache key: a build with other kernel settings (or tables) is another one.
    import torch

    from compile_engine.kernels_generated.tuning import KernelConfig
    from compile_engine.passes.base import PassContext
    from compile_engine.passes.manager import PassManager

    def uuid(ctx: PassContext) -> str:
        return PassManager(select(None), ctx).uuid()

    default = PassContext("h100", torch.bfloat16)
    assert default.kernel == KernelConfig()
    assert uuid(default) == uuid(PassContext("h100", torch.bfloat16, KernelConfig()))
    assert uuid(default) != uuid(PassContext("h100", torch.bfloat16, KernelConfig(pdl=False)))
