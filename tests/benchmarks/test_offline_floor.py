"""bench offline-floor: the run's accounting and the floor's arithmetic (the timing needs a GPU)."""

import json

import pytest
import torch

from compile_engine.benchmarks import offline_floor, render
from compile_engine.benchmarks.offline_floor import Workload, floor_seconds, spread_contexts


def test_workload_counts_what_any_schedule_computes():
    w = Workload(requests=1000, prompt_len=512, output_len=256)
    assert w.gemm_rows == 1000 * 767  # 512 prompt rows + 255 fed-back tokens
    assert w.lm_head_rows == 256_000
    assert w.decode_tokens == 255_000
    assert list(w.decode_contexts())[:2] == [513, 514] and w.decode_contexts()[-1] == 767
    # Output token j (1-based) is fed back at context 512 + j for j < 256.
    assert w.decode_key_reads == 1000 * sum(512 + j for j in range(1, 256))
    assert w.target_seconds() == pytest.approx(20.48)


def test_spread_contexts_covers_the_range_evenly():
    got = spread_contexts(range(513, 768), 256)
    assert len(got) == 256 and got[0] == 513 and got[-1] == 767
    assert got == sorted(got)
    assert sum(got) / len(got) == pytest.approx(640, abs=0.5)
    assert spread_contexts(range(5, 9), 1) == [5]


def test_floor_scales_each_part_by_the_work_it_measured():
    w = Workload(requests=10, prompt_len=4, output_len=3)  # 60 GEMM rows, 30 samples
    parts = floor_seconds(
        w, gemm_ms=1000.0, gemm_rows=30, lm_head_ms=500.0, lm_head_rows=10,
        decode_attention_ms=2000.0, decode_attention_keys=w.decode_key_reads // 2,
        prefill_attention_ms=100.0, prefill_attention_prompts=5,
    )  # fmt: skip
    assert parts["gemm"] == pytest.approx(2.0)
    assert parts["lm_head"] == pytest.approx(1.5)
    assert parts["decode_attention"] == pytest.approx(4.0)
    assert parts["prefill_attention"] == pytest.approx(0.2)
    assert parts["total"] == pytest.approx(7.7)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refuses_without_a_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        offline_floor.main([])
    assert e.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_render_shows_the_floor(tmp_path):
    gpu = {"samples": 3, "sm_clock_mhz": {"median": 1500, "min": 1400, "max": 1980},
           "power_w": {"median": 690.0, "max": 700.0}, "power_capped_fraction": 1.0}  # fmt: skip
    parts = {"gemm": 16.0, "lm_head": 0.5, "decode_attention": 5.0, "prefill_attention": 0.3}
    parts["total"] = sum(parts.values())
    measured = {k: {"ms": 1.0, "burst_ms": 0.9, "gpu": gpu} for k in parts if k != "total"}
    measured["decode_step_gemm"] = {"ms": 6.5, "burst_ms": 6.0, "gpu": gpu}
    record = {
        "name": "offline-floor", "benchmark": "offline_floor", "commit": "abc", "timestamp": "t",
        "device": {"name": "NVIDIA H200"}, "measured": measured, "floor_s": parts,
        "floor_burst_s": {k: v * 0.9 for k, v in parts.items()}, "target_s": 20.48,
        "gemm_tflops_settled": 650.0, "floor_output_tok_s": 256_000 / parts["total"],
    }  # fmt: skip
    (tmp_path / "offline-floor-nvidia-h200-abc.json").write_text(json.dumps(record))
    text = render.render(render.load_results(tmp_path))
    assert "at most 11,743 output tok/s" in text
    assert "| decode_attention | 5.00 | 4.50 | SM 1,500 MHz median" in text
    assert "6.50 ms settled" in text
