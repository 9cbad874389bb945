"""The Helion silu_and_mul kernel against `models.ops.silu_and_mul_ref`, its custom op, its
configs file and the Triton source it generates.

HELION_INTERPRET=1 is read when the kernel is defined (at import) and would leak into every
later test of this process, so the eager CPU cases run in a child pytest that has it from its
start (`test_interpreted_cases_in_subprocess`); this process checks what needs compiled mode
off a GPU: the Triton source (golden), the fake, the config lookup. The check at the spec's
shapes goes through the shared harness (benchmarks/kernel_harness.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from compile_engine.benchmarks.kernel_harness import check
from compile_engine.benchmarks.kernel_specs import spec_of
from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.configs import (
    CONFIG_DIR,
    ConfigEntry,
    ConfigTable,
    TargetConfigs,
    bucket_tokens,
)
from compile_engine.models.ops import silu_and_mul_ref

from pass_kit import run_interpreted

pytest.importorskip("helion", reason="helion is not installed (pip install helion==1.4.0)")
import helion  # noqa: E402

from compile_engine.kernels_generated import silu_and_mul_helion as k  # noqa: E402

INTERPRETED = k.interpreted()
# CPU cases run in the HELION_INTERPRET=1 child; the parent deselects them (tests/conftest.py).
interpreted = pytest.mark.interpreted_child("HELION_INTERPRET")
compiled_mode = pytest.mark.skipif(INTERPRETED, reason="needs Helion's compiled mode")
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA and compiled Helion"
)

# (T, I): decode, odd sizes that leave partial tiles, a chunk wider than one default tile.
SHAPES = [(1, 8), (2, 5), (7, 40), (33, 24), (3, 600)]
KEY = tuning.default().key  # the op's last argument: the kernel config the pass gives it


# --------------------------------------------------------------------------- interpreted (CPU)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"T{s[0]}-I{s[1]}")
def test_interpreted_kernel_equals_reference(shape, dtype):
    num_tokens, inter = shape
    x = torch.randn(num_tokens, 2 * inter, generator=torch.Generator().manual_seed(1)).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(k.silu_and_mul_kernel(gate, up), silu_and_mul_ref(x), rtol=0, atol=0)


@interpreted
def test_interpreted_custom_op_any_leading_dims():
    x = torch.randn(2, 3, 2 * 16)  # [B, T, 2I]: flattened to [B*T, 2I] and back
    out = torch.ops.ce_kernels.silu_and_mul_helion(x, KEY)
    assert out.shape == (2, 3, 16)
    torch.testing.assert_close(out, silu_and_mul_ref(x), rtol=0, atol=0)


@interpreted
def test_interpreted_check():
    assert check(spec_of("silu_and_mul_helion")) == 0.0


@interpreted
def test_interpreted_opaque_under_torch_compile():
    # The op stays one node (its fake gives the shape) with a dynamic token dimension.
    def mlp(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.ce_kernels.silu_and_mul_helion(x, KEY) @ w

    fn = torch.compile(mlp, backend="aot_eager", fullgraph=True, dynamic=True)
    w = torch.randn(12, 4)
    for num_tokens in (3, 9):
        x = torch.randn(num_tokens, 24)
        torch.testing.assert_close(fn(x, w), silu_and_mul_ref(x) @ w)


@pytest.mark.skipif(INTERPRETED, reason="this is the parent of the interpreted run")
def test_interpreted_cases_in_subprocess():
    child = run_interpreted(__file__, "HELION_INTERPRET", "-k", "interpreted and not subprocess")
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-4000:]
    assert " passed" in child.stdout and "skipped" not in child.stdout, child.stdout[-2000:]


# --------------------------------------------------------------------------- compiled mode


@compiled_mode
@pytest.mark.parametrize(
    "config,block",
    [(None, 512), ({"block_sizes": [4, 128], "num_warps": 2}, 128)],
    ids=["default", "4x128"],
)
def test_emits_triton_source(config, block):
    # Golden: Helion generates a Triton kernel for any config without a GPU.
    source = k.emit_triton(config)
    assert "@triton.jit" in source
    assert "def _helion_silu_and_mul_kernel(" in source
    assert f"tl.constexpr({block})" in source
    assert source.count("tl.load(") == 2 and source.count("tl.store(") == 1
    assert "tl.float32" in source  # silu in float32, as the reference does


@compiled_mode
def test_compiled_kernel_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the kernel runs")
    with pytest.raises(k.KernelUnavailableError, match="HELION_INTERPRET=1"):
        torch.ops.ce_kernels.silu_and_mul_helion(torch.randn(3, 8), KEY)


def test_fake_gives_output_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.ops.ce_kernels.silu_and_mul_helion(torch.empty(5, 2 * 96), KEY)
    assert out.shape == (5, 96)


@requires_cuda
@pytest.mark.gpu
def test_gpu_real_shapes_bf16():
    check(spec_of("silu_and_mul_helion"))  # I = 14336 and 1536, T = 1, 64, 256, 2048, bf16


# --------------------------------------------------------------------------- configs


def test_shipped_configs_file():
    table = ConfigTable.load(CONFIG_DIR / "silu_and_mul_helion.json")
    assert table.kernel == "silu_and_mul_helion" and table.key_names == ("I", "T")
    helion.Config(**table.default)  # the default is a valid Helion config
    for target in ("h100", "cpu"):
        section = table.targets[target]
        # Entries are written only by `bench kernel silu_and_mul_helion --tune`, which marks
        # the target tuned.
        assert section.tuned == bool(section.entries)


def test_config_comes_from_the_kernel_configs_table(tmp_path):
    # A table named in KernelConfig.tables is the one the launcher looks its tiles up in.
    from compile_engine.kernels_generated.tuning import KernelConfig

    table = ConfigTable.load(CONFIG_DIR / "silu_and_mul_helion.json")
    table.targets["h100"].entries.clear()
    table.default = {"block_sizes": [2, 64], "num_warps": 2}
    config = KernelConfig(tables={"silu_and_mul_helion": str(table.save(tmp_path / "t.json"))})
    assert k.config_for(config.key, "h100", 1, 1536) == helion.Config(**table.default)
    shipped = tuning.default().table("silu_and_mul_helion").lookup("h100", k.shape_key(1, 1536))
    assert k.config_for(KEY, "h100", 1, 1536) == helion.Config(**shipped)


def test_missing_target_config_falls_back_and_logs_once(caplog):
    table = ConfigTable.load(CONFIG_DIR / "silu_and_mul_helion.json")
    table.targets.pop("cpu")
    with caplog.at_level(logging.WARNING, logger="compile_engine.kernels_generated.configs"):
        for num_tokens in (1, 7, 300):
            assert table.lookup("cpu", k.shape_key(num_tokens, 1536)) == table.default
    lines = [r for r in caplog.records if "no tuned config" in r.getMessage()]
    assert len(lines) == 1 and "cpu" in lines[0].getMessage()


def test_nearest_key_lookup():
    entries = [
        ConfigEntry({"I": i, "T": t}, {"block_sizes": [1, i // 8 + t]})
        for i in (1536, 14336)
        for t in (1, 64, 2048)
    ]
    table = ConfigTable(
        "k", ("I", "T"), {"block_sizes": [1, 1]}, {"h100": TargetConfigs(True, entries)}
    )
    near = lambda num_tokens, inter: table.nearest("h100", k.shape_key(num_tokens, inter)).key
    assert near(1, 14336) == {"I": 14336, "T": 1}
    assert near(48, 1536) == {"I": 1536, "T": 64}
    assert near(4096, 4096) == {"I": 1536, "T": 2048}  # log2 4096 is nearer 1536 than 14336
    assert near(3000, 12288) == {"I": 14336, "T": 2048}
    assert table.nearest("cpu", {"I": 8, "T": 1}) is None


def test_bucket_tokens():
    assert [bucket_tokens(t) for t in (0, 1, 2, 3, 64, 65, 2048, 2049)] == [
        1,
        1,
        2,
        4,
        64,
        128,
        2048,
        4096,
    ]
