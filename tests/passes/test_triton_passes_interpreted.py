"""The numerics cases of the Triton fusion passes (rms_norm_triton, rotary_triton,
rotary_into_attention, silu_and_mul_triton), run under the Triton interpreter in one child pytest.

Each case compiles a tiny Llama with exactly its pass and with none and compares the logits
(pass_kit.assert_numerics_unchanged), which runs the Triton kernel on CPU tensors: that
needs TRITON_INTERPRET=1 from the start of the process, hence a child. One child for the four
files, not one each: a child pays seconds of imports (torch, transformers) before its first case."""

from __future__ import annotations

from pathlib import Path

import pytest

from pass_kit import run_interpreted

HERE = Path(__file__).resolve().parent
FILES = (
    "test_rms_norm_triton_pass.py",
    "test_rotary_triton_pass.py",
    "test_rotary_into_attention_pass.py",
    "test_silu_and_mul_triton_pass.py",
)


@pytest.mark.slow
def test_interpreted_numerics_in_one_child():
    first, *rest = (HERE / name for name in FILES)
    child = run_interpreted(first, "TRITON_INTERPRET", *map(str, rest), "-k", "interpreted")
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-4000:]
    assert f"{len(FILES)} passed" in child.stdout, child.stdout[-2000:]
