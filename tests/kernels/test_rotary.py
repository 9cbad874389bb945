"""The Triton rotary kernel against `models.ops.rotary_ref`: exact, since it rounds where the
reference does.

The CPU cases run in the TRITON_INTERPRET=1 child that test_triton_fusions_interpreted.py
starts (see test_add_rms_norm.py for why); GPU cases: bf16 at Llama-3-8B heads (the shared
harness's check, benchmarks/kernel_harness.py), and CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch

from compile_engine.benchmarks.kernel_harness import check
from compile_engine.benchmarks.kernel_specs import rotary_inputs, spec_of
from compile_engine.kernels_generated import rotary as k
from compile_engine.kernels_generated import tuning
from compile_engine.kernels_generated.configs import CONFIG_DIR, ConfigTable
from compile_engine.kernels_generated.tuning import KernelConfig
from compile_engine.models.ops import rotary_ref

interpreted = pytest.mark.interpreted_child("TRITON_INTERPRET")
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or k.INTERPRETED,
    reason="needs CUDA (and compiled, not interpreted, Triton)",
)

# (T, Hq, Hkv, D, rot_dim): GQA, MHA, head counts that leave partial head blocks, Qwen3's
# head_dim 24 (a half of 12, not a power of two), partial rotary (dims that pass through).
CASES = {
    "gqa": (5, 4, 2, 16, 16),
    "one_token": (1, 4, 2, 16, 16),
    "mha_odd_heads": (3, 6, 6, 16, 16),
    "head_dim_24": (4, 4, 2, 24, 24),
    "partial_rotary": (3, 4, 2, 32, 16),
}
KEY = tuning.default().key  # the op's last argument: the kernel config the pass gives it


def _inputs(case: str, dtype: torch.dtype, seed: int = 0):
    num_tokens, hq, hkv, head_dim, rot_dim = CASES[case]
    return rotary_inputs(
        num_tokens, hq, hkv, head_dim, rot_dim=rot_dim, max_positions=64, dtype=dtype,
        device="cpu", seed=seed,
    )  # fmt: skip


def _assert_exact(got: tuple, want: tuple) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=0, atol=0)


# --------------------------------------------------------------------------- CPU (interpreter)


@interpreted
@pytest.mark.parametrize("block_h", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_matches_reference(case, dtype, block_h):
    args = _inputs(case, dtype)
    _assert_exact(k.rotary_triton(*args, block_h=block_h), rotary_ref(*args))


@interpreted
def test_interpreted_contiguous_inputs_and_op():
    # q and k as standalone tensors (not QKV views), through the custom op and its config.
    positions, q, k_, cache = _inputs("gqa", torch.float32, seed=1)
    args = (positions, q.contiguous(), k_.contiguous(), cache)
    _assert_exact(torch.ops.ce_kernels.rotary(*args, KEY), rotary_ref(*args))
    assert check(spec_of("rotary")) == 0.0


@interpreted
def test_interpreted_empty_batch():
    positions, q, k_, cache = _inputs("gqa", torch.float32)
    q_out, k_out = k.rotary_triton(positions[:0], q[:0], k_[:0], cache)
    assert q_out.shape == (0, 4, 16) and k_out.shape == (0, 2, 16)


# --------------------------------------------------------------------------- anywhere


def test_fake_gives_output_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k_ = torch.empty(3, 8, 64), torch.empty(3, 2, 64)
        q_out, k_out = torch.ops.ce_kernels.rotary(
            torch.zeros(3, dtype=torch.long), q, k_, torch.empty(10, 64), KEY
        )
    assert q_out.shape == (3, 8, 64) and k_out.shape == (3, 2, 64)


def test_rejects_bad_cache():
    positions, q, k_, _ = _inputs("gqa", torch.float32)
    with pytest.raises(k.RotaryKernelError, match="even rot_dim"):
        k.rotary_triton(positions, q, k_, torch.zeros(64, 15))


def test_shipped_configs_file():
    table = ConfigTable.load(CONFIG_DIR / "rotary.json")
    assert table.kernel == "rotary" and table.key_names == ("HEADS", "D", "T")
    candidates = spec_of("rotary").candidates
    for target in ("h100", "cpu"):
        section = table.targets[target]
        assert section.tuned == bool(section.entries)  # entries come only from tuning
        for entry in section.entries:
            # The shipped entries are Llama-3-8B's: HEADS 40 = 32 q heads + 8 k heads.
            key = entry.key
            assert entry.config in candidates((key["T"], key["HEADS"] - 8, 8, key["D"]))


def test_launch_config_comes_from_the_kernel_configs_table(tmp_path):
    # A table named in KernelConfig.tables is the one the launcher looks its config up in.
    table = ConfigTable.load(CONFIG_DIR / "rotary.json")
    table.targets["cpu"].entries.clear()
    table.default = {"BLOCK_H": 1, "num_warps": 1}
    config = KernelConfig(tables={"rotary": str(table.save(tmp_path / "t.json"))})
    assert k.config_for(config.key, "cpu", 4, 6, 16) == {"BLOCK_H": 1, "num_warps": 1}
    shipped = tuning.default().table("rotary").lookup("cpu", k.shape_key(4, 6, 16))
    assert k.config_for(KEY, "cpu", 4, 6, 16) == shipped


# ------------------------------------------------------------------------ GPU (bf16, real shapes)


@pytest.mark.gpu
@requires_cuda
def test_gpu_real_shapes_bf16():
    assert check(spec_of("rotary")) == 0.0  # Llama-3-8B heads (32 / 8, D 128), T = 1-2048: exact


@pytest.mark.gpu
@requires_cuda
def test_gpu_cuda_graph_replay():
    # Captured once, replayed on new positions and activations: nothing value-dependent baked in.
    static = rotary_inputs(64, seed=1)
    fresh = rotary_inputs(64, seed=2)
    k.rotary(*static, KEY)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = k.rotary(*static, KEY)
    for dst, src in zip(static[:3], fresh[:3], strict=True):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    _assert_exact(outs, rotary_ref(*fresh))
