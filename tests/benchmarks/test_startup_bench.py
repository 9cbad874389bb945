"""bench startup end to end on the CPU, on a 2-layer random model: a build, then a fresh
process ready from the artifact. No assertion is about a time; the checks are that the
phases are reported apart and do not overlap, and that the weight read (on a thread beside
them in the engine) is measured alone in a process of its own."""

from __future__ import annotations

import json

import pytest

from compile_engine.benchmarks import make_model, startup

RECORD_KEYS = {"command", "commit", "dirty", "timestamp", "device", "versions"}


@pytest.mark.slow
def test_startup_end_to_end(tmp_path):
    model = make_model.make_model("tiny-llama", tmp_path / "model")
    results = tmp_path / "results"
    rc = startup.main(
        ["--model", str(model), "--target", "cpu", "--dtype", "float32", "--num-kv-blocks",
         "16", "--out", str(tmp_path / "artifact"), "--results-dir", str(results),
         "--max-cuda-graph-tokens", "1024", "--passes=-paged_attention_cpu"]
    )  # fmt: skip
    assert rc == 0
    # The bound reaches the build, which records it for the start from its artifact.
    manifest = json.loads((tmp_path / "artifact" / "manifest.json").read_text())
    assert manifest["engine_args"]["max_cuda_graph_tokens"] == 1024
    (path,) = results.glob("startup-*.json")
    data = json.loads(path.read_text())
    assert set(data) >= RECORD_KEYS
    # The pieces only (the CPU decode graph doubles a cold tiny build on CI's 2 cores; an
    # artifact with it loads without compiling in test_compiler).
    assert data["build_flags"] == [
        "--max-cuda-graph-tokens",
        "1024",
        "--passes=-paged_attention_cpu",
    ]
    phases = data["ready_phases"]
    assert {"import_s", "artifact_check_s", "model_init_s", "weights_wait_s", "tokenizer_s",
            "kv_cache_s", "compile_s", "gc_s"} <= set(phases)  # fmt: skip
    assert "weights_s" not in phases  # the read is not a phase: it overlaps them
    # Disjoint phases: together they never exceed the ready time they split.
    assert phases["unaccounted_s"] >= -0.005
    # Measured (a 2-layer model reads in milliseconds, which may round to 0.0).
    assert data["weights_read_s"] >= 0 and data["weights_read_in_engine_s"] >= 0
    assert data["startup_ready_minus_weights_s"] == pytest.approx(
        data["startup_ready_s"] - data["weights_read_s"], abs=0.011
    )
    breakdown = data["ready_breakdown"]
    assert set(breakdown["compile_breakdown"]) == {
        "dynamo_trace_s", "passes_s", "pieces_s", "backend_other_s", "before_first_run_s",
        "after_backend_s"
    }  # fmt: skip
    # Loading compiled nothing: every piece whole from AOTAutograd's cache.
    assert data["inductor_compiles_at_load"] == 0
    # The three pieces (compiler/compiled_model.py).
    assert breakdown["inductor_caches"]["aot_autograd_hits"] == 3
    assert breakdown["inductor_caches"]["fx_graph_misses"] == 0
    # The second start is timed with the same phases.
    warm = data["warm_ready_phases"]
    assert "weights_wait_s" in warm and warm["unaccounted_s"] >= -0.005
    assert data["warm_ready_minus_weights_s"] == pytest.approx(
        data["warm_ready_s"] - data["weights_read_s"], abs=0.02
    )
