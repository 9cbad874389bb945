"""bench gemm's sweep: which configs it tries, and that each is a valid skinny_gemm call."""

from __future__ import annotations

from dataclasses import fields

from benchmarks import gemm
from kernels_generated.skinny_gemm import LaunchConfig

PARAMS = {f.name for f in fields(LaunchConfig)}


def test_decode_rows_try_the_ragged_row_partition():
    names = [gemm.triton_name(c) for c in gemm.candidates(4096, 4096, 1)]
    assert any(n.endswith("/r1") for n in names) and any(n.endswith("/r2") for n in names)
    assert not any("/r" in gemm.triton_name(c) for c in gemm.candidates(4096, 4096, 256))


def test_every_candidate_is_a_valid_call():
    for rows in (1, 4, 16, 64, 256):
        for config in gemm.candidates(6144, 4096, rows):
            assert set(config) <= PARAMS, config
            assert config["mode"] in ("swap", "dot", "fma")


def test_render_shows_cublas_against_the_best_triton_and_ragged_configs():
    from benchmarks import render

    cell = {"shape": "o_proj", "M": 1, "variants": {
        "cublas": {"us": 13.5},
        "triton:swap/16x64x256/s1/w4/p4": {"us": 11.6},
        "triton:swap/16x16x256/s1/w4/p4/r1": {"us": 11.8},
        "triton:swap/16x16x512/s1/w4/p3": {"error": "OutOfResources"},
    }}  # fmt: skip
    lines = render._gemm({"cells": [cell], "timing": "graph replay"})
    row = next(line for line in lines if line.startswith("| o_proj"))
    assert "11.60 (`swap/16x64x256/s1/w4/p4`)" in row and "x1.164" in row
    assert row.endswith("11.80 (`swap/16x16x256/s1/w4/p4/r1`) |")


def test_render_shows_the_decode_attention_sweep():
    from benchmarks import render

    rows = [{"name": "table", "bs256_c100": 38.36, "bs1_c32k": 50.67},
            {"name": "32/2/2/128", "bs256_c100": 37.89, "bs1_c32k": None}]  # fmt: skip
    lines = render._pa_decode_sweep({"rows": rows})
    assert "| config | 256 x ctx 100 | 1 x ctx 32k |" in lines
    assert "| `32/2/2/128` | 37.9 | — |" in lines
