"""The CPU cases of the Triton fusion kernels' tests (add_rms_norm, rotary, silu_and_mul,
argmax, the integer weight-only GEMM) and of the shared kernel harness
(tests/benchmarks/test_kernel_harness.py), run under the Triton interpreter in one child pytest.

TRITON_INTERPRET=1 must be set before triton is first imported and would leak into every later
test of this process, so those cases (marked interpreted_child) run in a child that has it from
its start. One child for the five files, not one each: a child costs seconds of imports on the
2-core CI machine before its first case."""

from __future__ import annotations

from pathlib import Path

import pytest

from pass_kit import run_interpreted

HERE = Path(__file__).resolve().parent
FILES = (
    "test_add_rms_norm.py",
    "test_rotary.py",
    "test_silu_and_mul_triton.py",
    "test_argmax.py",
    "test_int_linear.py",
    "../benchmarks/test_kernel_harness.py",
)


@pytest.mark.slow
def test_interpreted_cases_in_one_child():
    first, *rest = (HERE / name for name in FILES)
    child = run_interpreted(first, "TRITON_INTERPRET", *map(str, rest), "-k", "interpreted")
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-4000:]
    summary = child.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, child.stdout[-2000:]
