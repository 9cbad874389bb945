"""bench gemm's sweep: which configs it tries, and that each is a valid skinny_gemm call."""

from __future__ import annotations

import inspect

from benchmarks import gemm
from kernels_generated.skinny_gemm import skinny_gemm

PARAMS = set(inspect.signature(skinny_gemm).parameters) - {"x", "w"}


def test_decode_rows_try_the_ragged_row_partition():
    names = [gemm.triton_name(c) for c in gemm.candidates(4096, 4096, 1)]
    assert any(n.endswith("/r1") for n in names) and any(n.endswith("/r2") for n in names)
    assert not any("/r" in gemm.triton_name(c) for c in gemm.candidates(4096, 4096, 256))


def test_every_candidate_is_a_valid_call():
    for rows in (1, 4, 16, 64, 256):
        for config in gemm.candidates(6144, 4096, rows):
            assert set(config) <= PARAMS, config
            assert config["mode"] in ("swap", "dot", "fma")
