"""bench gemm's sweep: which configs it tries, and that each is a valid skinny_gemm call."""

from __future__ import annotations

from dataclasses import fields

from compile_engine.benchmarks import gemm
from compile_engine.kernels_generated.skinny_gemm import LaunchConfig

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
    from compile_engine.benchmarks import render

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


def test_fused_norm_sweep_tries_valid_calls_without_split():
    from compile_engine.benchmarks import gemm_norm

    for gated in (False, True):
        configs = gemm_norm.candidates(gated)
        assert configs and all(set(c) <= PARAMS and c["split_k"] == 1 for c in configs)
        assert len({gemm_norm.label(c) for c in configs}) == len(configs)


def test_fused_norm_records_go_where_the_fused_launch_won(tmp_path):
    import json

    from compile_engine.benchmarks import gemm_norm
    from compile_engine.kernels_generated.configs import CONFIG_DIR, ConfigTable

    # The shipped table without its fused records.
    shipped = json.loads((CONFIG_DIR / "skinny_gemm.json").read_text())
    for entry in shipped["targets"]["h100"]["entries"]:
        entry.pop("fused", None)
    path = tmp_path / "skinny_gemm.json"
    path.write_text(json.dumps(shipped))
    config = gemm_norm.candidates(True)[0]

    def cell(name, m, unfused_us, fused_us):
        n_size, k_size = gemm.SHAPES[name]
        return {"shape": name, "N": n_size, "K": k_size, "M": m, "gated": gemm_norm.FUSED[name],
                "unfused_us": unfused_us, "best": "b", "speedup_vs_unfused": unfused_us / fused_us,
                "variants": {"b": {"us": fused_us, "config": config}}}  # fmt: skip

    cells = [
        cell("gate_up", 1, 60.0, 50.0),
        cell("qkv", 1, 18.0, 17.9),
        cell("gate_up", 4, 60.0, 70.0),
    ]
    gemm_norm.write_configs(cells, str(path), 1.03, {"sweep": "gemm-norm@test"})
    entries = {(e.key["N"], e.key["M"]): e for e in ConfigTable.load(path).targets["h100"].entries}
    won = entries[28672, 1].info["fused"]
    assert won == {"gated": {"config": config, "fused_us": 50.0, "unfused_us": 60.0,
                             "sweep": "gemm-norm@test"}}  # fmt: skip
    assert "fused" not in entries[6144, 1].info  # x1.006: below --min-speedup
    assert "fused" not in entries[28672, 4].info
    # A later sweep that loses removes the record; the GEMM entries stay as they were.
    gemm_norm.write_configs([cell("gate_up", 1, 60.0, 61.0)], str(path), 1.03, {})
    reloaded = json.loads(path.read_text())["targets"]["h100"]["entries"]
    assert not any("fused" in e for e in reloaded)
    assert [e["config"] for e in reloaded] == [
        e["config"] for e in shipped["targets"]["h100"]["entries"]
    ]


def test_a_sweep_rewrites_only_its_cells_keeping_fused_records_and_a_b_choices(tmp_path):
    # `bench gemm --write-configs` over some shapes and rows: their entries take the sweep's
    # choice and times; every other entry stays as it was, and so do each entry's fused
    # records (bench gemm-norm's) and a kernel an engine A/B chose (chosen_by), which takes
    # only the sweep's best config for that kernel.
    import json

    from compile_engine.kernels_generated.configs import CONFIG_DIR

    shipped = json.loads((CONFIG_DIR / "skinny_gemm.json").read_text())
    path = tmp_path / "skinny_gemm.json"
    path.write_text(json.dumps(shipped))

    def by_key(table: dict) -> dict:
        return {gemm._key(e["key"]): e for e in table["targets"]["h100"]["entries"]}

    before = by_key(shipped)
    qkv, down, o_proj = (6144, 4096, 1), (4096, 14336, 1), (4096, 4096, 256)
    assert "fused" in before[qkv] and "chosen_by" in before[down]  # what the test is about
    assert before[down]["config"]["kernel"] == "triton"
    config = gemm.candidates(4096, 4096, 1)[0]

    def cell(key, cublas_us, triton_us):
        n_size, k_size, m = key
        return {"N": n_size, "K": k_size, "M": m, "best_triton": "t",
                "variants": {"cublas": {"us": cublas_us}, "cublaslt": {"us": cublas_us},
                             "t": {"us": triton_us, "config": config}}}  # fmt: skip

    cells = [cell(qkv, 20.0, 10.0), cell(down, 30.0, 29.9), cell(o_proj, 10.0, 20.0)]
    gemm.write_configs(cells, str(path), 1.05, {"sweep": "gemm@test"})
    written = json.loads(path.read_text())
    after = by_key(written)
    assert list(after) == list(before)
    assert written["targets"]["h100"]["note"] == shipped["targets"]["h100"]["note"]
    for key, entry in before.items():
        if key not in (qkv, down, o_proj):
            assert after[key] == entry, key
    assert after[qkv]["config"] == {"kernel": "triton", **config}
    assert after[qkv]["fused"] == before[qkv]["fused"] and after[qkv]["sweep"] == "gemm@test"
    # x1.003 is under the sweep's 5% rule, but the A/B chose Triton: its config is the sweep's.
    assert after[down]["config"] == {"kernel": "triton", **config}
    assert after[down]["chosen_by"] == before[down]["chosen_by"]
    assert after[o_proj]["config"] == {"kernel": "cublas"}
    assert after[o_proj]["triton_us"] == 20.0


def test_shared_rows_give_a_shapes_few_row_cells_one_triton_config(tmp_path):
    # --shared-rows 16: the cells of <= 16 rows of a shape take the Triton config of least
    # summed time among those timed in all of them (a row's bits then do not depend on the
    # row count: lossless greedy speculation, issue 33), even where a cell's own best or
    # cuBLAS was faster; cells above 16 rows keep the per-cell rule.
    import json

    from compile_engine.kernels_generated.configs import ConfigTable

    path = tmp_path / "skinny_gemm.json"
    table = {"kernel": "skinny_gemm", "key": ["N", "K", "M"], "default": {"kernel": "cublas"}}
    path.write_text(json.dumps({**table, "targets": {}}))
    a, b = gemm.candidates(960, 576, 1)[:2]

    def cell(m, times: dict, cublas_us=5.0):
        variants = {"cublas": {"us": cublas_us}, "cublaslt": {"us": cublas_us}}
        variants.update({f"triton:{n}": {"us": us, "config": {"a": a, "b": b, "c": b}[n]}
                         for n, us in times.items()})  # fmt: skip
        best = min((n for n in variants if n.startswith("triton")), key=lambda n: variants[n]["us"])
        return {"N": 960, "K": 576, "M": m, "variants": variants, "best_triton": best}

    cells = [
        cell(1, {"a": 3.0, "b": 3.5, "c": 2.0}),  # c: not timed at every row count
        cell(8, {"a": 3.4, "b": 3.0}, cublas_us=2.5),  # cuBLAS wins this cell alone
        cell(64, {"a": 9.0, "b": 8.0}, cublas_us=10.0),
    ]
    gemm.write_configs(cells, str(path), 1.05, {"sweep": "gemm@test"}, shared_rows=16)
    entries = {e.key["M"]: e for e in ConfigTable.load(path).targets["h100"].entries}
    assert entries[1].config == entries[8].config == {"kernel": "triton", **a}  # 6.4 < 6.5 us
    assert entries[8].info["shared_rows"] == 16 and entries[8].info["triton_us"] == 3.4
    assert entries[64].config == {"kernel": "triton", **b}
    # Without the flag each cell takes its own best.
    gemm.write_configs(cells, str(path), 1.05, {"sweep": "gemm@test"})
    entries = {e.key["M"]: e for e in ConfigTable.load(path).targets["h100"].entries}
    assert (
        entries[1].config == {"kernel": "triton", **b} and entries[8].config["kernel"] == "cublas"
    )


def test_render_shows_the_unfused_chain_against_the_best_fused_launch():
    from compile_engine.benchmarks import render

    cell = {
        "shape": "gate_up",
        "M": 1,
        "gated": True,
        "gemm": "triton",
        "unfused_us": 59.02,
        "best": "128x128/w8/p3",
        "speedup_vs_unfused": 1.033,
        "variants": {"128x128/w8/p3": {"us": 57.15}, "64x128/w8/p4": {"us": 62.46}},
    }
    lost = {"shape": "qkv", "M": 2, "gated": False, "gemm": "cublas", "unfused_us": 17.4,
            "variants": {}}  # fmt: skip
    lines = render._gemm_norm({"cells": [cell, lost], "timing": "graph replay"})
    assert "| gate_up + silu | 1 | 59.02 (triton) | 57.15 (`128x128/w8/p3`) | x1.033 |" in lines
    assert "| qkv | 2 | 17.40 (cublas) | — | — |" in lines


def test_time_configs_times_what_matches_and_records_the_rest():
    """bench fp8-gemm's and int-gemm's sweep loop (benchmarks/gemm.time_configs), on CPU with
    a stand-in timer: a config that matches the reference is timed over every operand set, a
    wrong one and one that raises are kept as failures, those past the deadline counted."""
    import time

    import torch

    from compile_engine.benchmarks.gemm import time_configs

    x = torch.randn(3, 8)
    operands = [(torch.randn(5, 8),) for _ in range(2)]
    want = x @ operands[0][0].t()

    def call_of(config):
        if config["kind"] == "raises":
            raise RuntimeError("out of resource: shared memory")
        scale = 1.0 if config["kind"] == "right" else 1.5
        return lambda w: scale * (x @ w.t())

    timings = iter([7.0, 3.0])
    seen = []

    def timer(calls):
        seen.append(len(calls))
        return next(timings)

    configs = [{"kind": k, "i": i} for i, k in enumerate(["right", "wrong", "raises", "right"])]
    cell = {"variants": {"cublas": {"us": 9.0}}}
    best = time_configs(cell, configs, call_of, operands, want, 4000, time.monotonic() + 60,
                        lambda c: f"{c['kind']}{c['i']}", timer)  # fmt: skip
    assert seen == [2, 2] and cell["best"] == "right3" and best["us"] == 3.0
    assert best["tb_s"] == round(4000 / 3.0 / 1e6, 3) and best["config"] == configs[3]
    assert set(cell["variants"]) == {"cublas", "right0", "right3"}
    assert [f["variant"] for f in cell["failed"]] == ["wrong1", "raises2"]
    assert "rel_err" in cell["failed"][0] and "shared memory" in cell["failed"][1]["error"]
    late = {"variants": {}}
    assert time_configs(late, configs, call_of, operands, want, 1, time.monotonic() - 1,
                        str, timer) is None  # fmt: skip
    assert late["skipped_over_budget"] == 4 and "best" not in late


def test_int_gemm_candidates_are_valid_launches_every_dequant_and_operand_form():
    from compile_engine.benchmarks import int_gemm
    from compile_engine.kernels_generated.int_linear import IntLaunch

    for rows in (1, 16, 64):
        configs = int_gemm.candidates(rows)
        launches = [IntLaunch(**c) for c in configs]
        assert all(c["block_k"] <= int_gemm.GROUP for c in configs)  # a tile in one group
        dots = [launch for launch in launches if launch.mode == "dot"]
        assert {(d.dequant, d.swap) for d in dots} == {
            (d, w) for d in ("convert", "bits") for w in (False, True)
        }
        assert len({int_gemm.name_of(c) for c in configs}) == len(configs)
    assert any(c["mode"] == "fma" for c in int_gemm.candidates(1))
    assert {c["mode"] for c in int_gemm.candidates(1, ("fma",))} == {"fma"}
    assert not any(c["mode"] == "fma" for c in int_gemm.candidates(16))


def test_int_gemm_write_configs_replaces_the_swept_keys_and_keeps_the_rest(tmp_path, monkeypatch):
    import shutil
    from pathlib import Path

    from compile_engine.benchmarks import int_gemm
    from compile_engine.kernels_generated import configs

    monkeypatch.setattr(configs, "tuning_provenance", lambda dtype: {"dtype": dtype})  # no GPU
    path = tmp_path / "int_gemm.json"
    shutil.copy(Path(configs.__file__).parent / "configs" / "int_gemm.json", path)
    before = configs.ConfigTable.load(str(path)).targets["h100"].entries
    fma = dict(mode="fma", block_m=1, block_n=256, block_k=64, num_warps=4, num_stages=1,
               programs_per_sm=2)  # fmt: skip
    cell = {"weights": "int4", "N": 4096, "K": 4096, "M": 1, "best": "f",
            "variants": {"f": {"us": 5.0, "config": fma}, "bf16_cublas": {"us": 13.0}}}  # fmt: skip
    int_gemm.write_configs([cell], "int4", str(path))
    after = configs.ConfigTable.load(str(path)).targets["h100"].entries
    keyed = {(e.key["N"], e.key["K"], e.key["M"]): e for e in after}
    assert len(after) == len(before) and keyed[(4096, 4096, 1)].config == fma
    for e in before:
        if (e.key["N"], e.key["K"], e.key["M"]) != (4096, 4096, 1):
            assert keyed[(e.key["N"], e.key["K"], e.key["M"])].config == e.config
