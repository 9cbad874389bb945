"""The Triton rms_norm / add_rms_norm kernel against `models.ops.rms_norm_ref` and
`add_rms_norm_ref`.

TRITON_INTERPRET=1 is read when triton is first imported and would leak into every later test
of this process, so the CPU cases (marked interpreted_child) run in one child pytest, with
those of test_rotary.py and test_silu_and_mul_triton.py, started by
test_triton_fusions_interpreted.py; this process checks what needs no kernel launch: the fake,
the errors, the configs file. GPU cases: bf16 at Llama-3-8B and Qwen3 q/k-norm shapes. The
check at the spec's shapes goes through the shared harness (benchmarks/kernel_harness.py).
`TRITON_INTERPRET=1 pytest tests/kernels/test_add_rms_norm.py` runs the CPU cases directly."""

from __future__ import annotations

import pytest
import torch

from compile_engine.benchmarks.kernel_harness import check
from compile_engine.benchmarks.kernel_specs import norm_tolerance, spec_of
from compile_engine.kernels_generated import add_rms_norm as k
from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.configs import CONFIG_DIR, ConfigTable
from compile_engine.kernels_generated.tuning import KernelConfig
from compile_engine.models.ops import add_rms_norm_ref, rms_norm_ref

interpreted = pytest.mark.interpreted_child("TRITON_INTERPRET")
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or k.INTERPRETED,
    reason="needs CUDA (and compiled, not interpreted, Triton)",
)

# (rows, hidden): one row, a hidden size that is not a power of two, a wider one.
SHAPES = [(1, 64), (7, 48), (4, 200)]
KEY = tuning.default().key  # the ops' last argument: the kernel config the pass gives them


def _inputs(num_rows: int, hidden: int, dtype: torch.dtype, device: str = "cpu"):
    gen = torch.Generator(device=device).manual_seed(num_rows * 1000 + hidden)
    x = (3 * torch.randn(num_rows, hidden, device=device, generator=gen)).to(dtype)
    r = torch.randn(num_rows, hidden, device=device, generator=gen).to(dtype)
    w = (1 + 0.2 * torch.randn(hidden, device=device, generator=gen)).to(dtype)
    return x, r, w


# --------------------------------------------------------------------------- CPU (interpreter)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"T{s[0]}-H{s[1]}")
def test_interpreted_matches_reference(shape, dtype):
    x, r, w = _inputs(*shape, dtype)
    tol = norm_tolerance(dtype)
    torch.testing.assert_close(k.rms_norm(x, w, 1e-5, KEY), rms_norm_ref(x, w, 1e-5), **tol)
    got_norm, got_sum = k.add_rms_norm(x, r, w, 1e-6, KEY)
    want_norm, want_sum = add_rms_norm_ref(x, r, w, 1e-6)
    torch.testing.assert_close(got_sum, want_sum, rtol=0, atol=0)  # one rounding, same as ATen
    torch.testing.assert_close(got_norm, want_norm, **tol)


@interpreted
def test_interpreted_strided_3d_rows():
    # Qwen3's q norm: [T, heads, D] views of the QKV output, rows addressed by two strides.
    qkv = torch.randn(5, 8 * 24, generator=torch.Generator().manual_seed(3))
    q = qkv[:, : 4 * 24].view(5, 4, 24)  # [T, Hq, D], not contiguous
    w = torch.randn(24, generator=torch.Generator().manual_seed(4))
    out = k.rms_norm(q, w, 1e-6, KEY)
    assert out.shape == q.shape and out.stride() == torch.empty_like(q).stride()
    torch.testing.assert_close(out, rms_norm_ref(q, w, 1e-6), **norm_tolerance(torch.float32))


@interpreted
def test_interpreted_empty_and_check():
    x, r, w = _inputs(0, 64, torch.float32)
    assert k.add_rms_norm(x, r, w, 1e-5, KEY)[0].shape == (0, 64)
    assert check(spec_of("add_rms_norm")) < 1e-5  # both ops at the spec's CPU shapes


@interpreted
def test_interpreted_opaque_under_torch_compile():
    # One opaque node with a dynamic token count: what Inductor receives after the pass.
    def block(x, r, w):
        normed, summed = torch.ops.ce_kernels.add_rms_norm(x, r, w, 1e-5, KEY)
        return normed * 2, summed

    fn = torch.compile(block, backend="aot_eager", fullgraph=True, dynamic=True)
    for num_rows in (3, 9):
        x, r, w = _inputs(num_rows, 32, torch.float32)
        got, want = fn(x, r, w), add_rms_norm_ref(x, r, w, 1e-5)
        torch.testing.assert_close(got[0], want[0] * 2, **norm_tolerance(torch.float32))
        torch.testing.assert_close(got[1], want[1])


# --------------------------------------------------------------------------- anywhere


def test_fake_gives_output_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 96)
        normed, summed = torch.ops.ce_kernels.add_rms_norm(x, x, torch.empty(96), 1e-5, KEY)
        out = torch.ops.ce_kernels.rms_norm(x, torch.empty(96), 1e-5, KEY)
    assert normed.shape == summed.shape == out.shape == (5, 96)


def test_errors_say_what_to_do():
    x = torch.zeros(2, 8)
    with pytest.raises(k.RmsNormKernelError, match="weight"):
        k.rms_norm_triton(x, torch.zeros(4), 1e-5)
    with pytest.raises(k.RmsNormKernelError, match="--passes -rms_norm_triton"):
        k.rms_norm_triton(torch.zeros(1, 2 * k.MAX_HIDDEN), torch.zeros(2 * k.MAX_HIDDEN), 1e-5)
    if not k.INTERPRETED:
        with pytest.raises(k.RmsNormKernelError, match="TRITON_INTERPRET=1"):
            k.rms_norm_triton(x, torch.zeros(8), 1e-5)


def test_shipped_configs_file():
    table = ConfigTable.load(CONFIG_DIR / "add_rms_norm.json")
    assert table.kernel == "add_rms_norm" and table.key_names == ("H", "T")
    candidates = spec_of("add_rms_norm").candidates
    for target in ("h100", "cpu"):
        section = table.targets[target]
        assert section.tuned == bool(section.entries)  # entries come only from tuning
        for entry in section.entries:
            assert entry.config in candidates((entry.key["T"], entry.key["H"]))


def test_launch_config_comes_from_the_kernel_configs_table(tmp_path):
    # A table named in KernelConfig.tables is the one the launcher looks its config up in.
    table = ConfigTable.load(CONFIG_DIR / "add_rms_norm.json")
    table.targets["cpu"].entries.clear()
    table.default = {"num_warps": 2}
    config = KernelConfig(tables={"add_rms_norm": str(table.save(tmp_path / "t.json"))})
    assert k.config_for(config.key, "cpu", 1, 64) == {"num_warps": 2}
    shipped = tuning.default().table("add_rms_norm").lookup("cpu", k.shape_key(1, 64))
    assert k.config_for(KEY, "cpu", 1, 64) == shipped


# ------------------------------------------------------------------------ GPU (bf16, real shapes)


@pytest.mark.gpu
@requires_cuda
def test_gpu_real_shapes_bf16():
    check(spec_of("add_rms_norm"))  # hidden 4096 at T = 1, 64, 256, 2048, both ops, one bf16 ulp


@pytest.mark.gpu
@requires_cuda
def test_gpu_qk_norm_rows_bf16():
    qkv = torch.randn(300, (32 + 16) * 128, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, : 32 * 128].view(300, 32, 128)  # [T, Hq, D] strided, as Qwen3 normalises it
    w = torch.randn(128, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(
        k.rms_norm(q, w, 1e-6, KEY), rms_norm_ref(q, w, 1e-6), **norm_tolerance(torch.bfloat16)
    )


def test_up_to_16_rows_take_the_one_row_config(monkeypatch: pytest.MonkeyPatch):
    # The warps set the sum's reduction tree: a verification step's rows (2-16) must be
    # normalised with the one-row decode's config (issue 33). The shipped table's nearest
    # entry for SmolLM2's 576 at 8 rows is a 1-warp H=128 one, at 1 row the 8-warp H=4096.
    table = ConfigTable.load(CONFIG_DIR / "add_rms_norm.json")
    assert table.lookup("h100", {"H": 576, "T": 8}) != table.lookup("h100", {"H": 576, "T": 1})
    asked = []

    class Stop(Exception):
        pass

    def config_for(key, target, rows_bucket, hidden):
        asked.append(rows_bucket)
        raise Stop

    monkeypatch.setattr(k, "config_for", config_for)
    monkeypatch.setattr(k, "_validate", lambda *args: None)  # CPU tensors: no launch follows
    for rows in (1, 2, 8, 16, 17, 64):
        with pytest.raises(Stop):
            k.rms_norm_triton(torch.zeros(rows, 576), torch.ones(576), 1e-5)
    assert asked == [1, 1, 1, 1, 32, 64]
