"""benchmarks.telemetry: nvidia-smi samples summarised, and no sampler without a GPU."""

from __future__ import annotations

import pytest
import torch

from compile_engine.benchmarks import render
from compile_engine.benchmarks.telemetry import GpuSampler, summarize

# Rows as the H200 printed them through a batch-256 decode run (clocks.sm, power.draw,
# clocks_throttle_reasons.active), with an idle row and two unreadable ones.
ROWS = [
    "1980, 124.90, 0x0000000000000000",
    "1455, 695.68, 0x0000000000000004",
    "1500, 693.21, 0x0000000000000004",
    "345, 80.81, 0x0000000000000001",
    "1605, 679.75, 0x0000000000000044",
    "[N/A], 80.00, 0x0",
    "garbage",
]


def test_summarize_reads_clocks_power_and_reasons():
    s = summarize(ROWS)
    assert s["samples"] == 5
    assert s["sm_clock_mhz"] == {"min": 345, "median": 1500, "max": 1980}
    assert s["power_w"] == {"median": 679.8, "max": 695.7}
    assert s["power_capped_fraction"] == 0.6  # 0x4 set in three of five
    assert s["thermal_slowdown_fraction"] == 0.2  # 0x40 in one


def test_render_cell():
    cell = render._gpu_cell(summarize(ROWS))
    assert cell == "SM 1,500 MHz median (345-1,980), 680 W median, power-capped 60%"
    assert render._gpu_cell({"error": "nvidia-smi not found"}) == "nvidia-smi not found"


def test_summarize_without_samples_says_so():
    assert summarize([]) == {"samples": 0, "error": "no readable nvidia-smi samples"}
    assert summarize(["x, y, z"])["samples"] == 0


def test_no_sampler_on_cpu():
    with GpuSampler(torch.device("cpu")) as gpu:
        pass
    assert gpu.proc is None
    assert gpu.summary == {"error": "no GPU (cpu)"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_samples_a_busy_gpu():
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    with GpuSampler(torch.device("cuda"), interval_ms=100) as gpu:
        for _ in range(200):
            x @ x
        torch.cuda.synchronize()
    assert gpu.summary["samples"] >= 1, gpu.summary
    assert gpu.summary["sm_clock_mhz"]["max"] > 0
