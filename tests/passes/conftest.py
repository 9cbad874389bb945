"""The graph most pass tests rewrite: the tiny Llama (tests/tiny_models) captured once per
module, as the compiler captures it. Files that test another model define their own `graph`.
`numerics_with`: pass_kit's numerics comparison with a kernel config of the test's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from compile_engine.kernels_generated.tuning import KernelConfig
from compile_engine.passes.base import PassContext

from pass_kit import capture_graph, compiled_logits, get_pass, relative_error


@pytest.fixture(scope="module")
def graph():
    return capture_graph("llama")


@pytest.fixture
def numerics_with() -> Callable[..., dict[str, float]]:
    """`run(kernel, pass_name, model_dir)`: as pass_kit.assert_numerics_unchanged (h100,
    float16 unless given, the logits with the pass within rtol of those with no pass), the
    pass's kernel ops launching with `kernel` (a KernelConfig naming a table the test wrote):
    the pass gives them its key, as a build gives them the engine's."""

    def run(
        kernel: KernelConfig,
        pass_name: str,
        model_dir: Path,
        *,
        dtype: torch.dtype = torch.float16,
        rtol: float = 2e-3,
    ) -> dict[str, float]:
        ctx = PassContext("h100", dtype, kernel)
        pass_ = get_pass(pass_name)
        on, counts = compiled_logits(model_dir, [pass_], ctx)
        assert counts[pass_.name] > 0, f"{pass_name} matched nothing: nothing to compare"
        off, _ = compiled_logits(model_dir, [], ctx)
        worst = max(relative_error(a, b) for a, b in zip(on, off, strict=True))
        assert worst <= rtol, f"{pass_name}: logits off by {worst:.2e} (relative), rtol {rtol}"
        return {"max_relative_error": worst, "matches": counts[pass_.name]}

    return run
