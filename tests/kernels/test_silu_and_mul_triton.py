"""The plain Triton silu_and_mul kernel against `models.ops.silu_and_mul_ref`.

The CPU cases run in the TRITON_INTERPRET=1 child that test_triton_fusions_interpreted.py
starts (see test_add_rms_norm.py for why); the GPU case: bf16 at Llama-3-8B's intermediate
size, through the shared harness (benchmarks/kernel_harness.py)."""

from __future__ import annotations

import pytest
import torch

from compile_engine.benchmarks.kernel_harness import check
from compile_engine.benchmarks.kernel_specs import spec_of
from compile_engine.kernels_generated import silu_and_mul as k
from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.configs import CONFIG_DIR, ConfigTable
from compile_engine.kernels_generated.tuning import KernelConfig
from compile_engine.models.ops import silu_and_mul_ref

interpreted = pytest.mark.interpreted_child("TRITON_INTERPRET")
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or k.INTERPRETED,
    reason="needs CUDA (and compiled, not interpreted, Triton)",
)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape,block", [((1, 8), 16), ((5, 40), 16), ((3, 600), 256)])
def test_interpreted_matches_reference(shape, block, dtype):
    # Blocks smaller than I: several programs per token, the last one partly masked.
    num_tokens, inter = shape
    x = torch.randn(num_tokens, 2 * inter, generator=torch.Generator().manual_seed(1)).to(dtype)
    torch.testing.assert_close(k.silu_and_mul_triton(x, block=block), silu_and_mul_ref(x))


@interpreted
def test_interpreted_op_any_leading_dims_and_check():
    x = torch.randn(2, 3, 2 * 16)  # [B, T, 2I]: flattened to [B*T, 2I] and back
    out = torch.ops.ce_kernels.silu_and_mul(x, tuning.default().key)
    assert out.shape == (2, 3, 16)
    torch.testing.assert_close(out, silu_and_mul_ref(x))
    assert check(spec_of("silu_and_mul")) < 1e-5


def test_shipped_configs_file():
    table = ConfigTable.load(CONFIG_DIR / "silu_and_mul.json")
    assert table.kernel == "silu_and_mul" and table.key_names == ("I", "T")
    candidates = spec_of("silu_and_mul").candidates
    for target in ("h100", "cpu"):
        section = table.targets[target]
        assert section.tuned == bool(section.entries)  # entries come only from tuning
        for entry in section.entries:
            assert entry.config in candidates((entry.key["T"], entry.key["I"]))


def test_launch_config_comes_from_the_kernel_configs_table(tmp_path):
    # A table named in KernelConfig.tables is the one the launcher looks its config up in.
    table = ConfigTable.load(CONFIG_DIR / "silu_and_mul.json")
    table.targets["cpu"].entries.clear()
    table.default = {"BLOCK": 16, "num_warps": 1}
    config = KernelConfig(tables={"silu_and_mul": str(table.save(tmp_path / "t.json"))})
    assert k.config_for(config.key, "cpu", 4, 40) == {"BLOCK": 16, "num_warps": 1}
    shipped = tuning.default().table("silu_and_mul").lookup("cpu", k.shape_key(4, 40))
    assert k.config_for(tuning.default().key, "cpu", 4, 40) == shipped


@pytest.mark.gpu
@requires_cuda
def test_gpu_real_shapes_bf16():
    check(spec_of("silu_and_mul"))  # I = 14336 at T = 1, 64, 256, 2048, bf16
