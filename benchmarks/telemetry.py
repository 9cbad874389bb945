"""The GPU's clocks and power sampled beside a timed run: did it sit at its power cap?

On the H200 the compute-heavy runs (decode at batch 256, offline) hold the board at its 700 W
cap, and the driver lowers the SM clock (1,455-1,695 MHz against 1,980 at batch 1; the
`nvidia-smi` reason bit 0x4, software power cap). A number from such a run is bound by
energy per token as much as by the kernels' time, so the JSON says so: `GpuSampler` runs
`nvidia-smi --loop-ms` beside the run and `summarize` turns its samples into the SM clock's
range, the power drawn, and the share of samples under the power cap or a thermal slowdown.
No GPU, no nvidia-smi, or a sampler that fails: the summary says why, the run goes on.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
from types import TracebackType

import torch

QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"
# nvidia-smi's clocks event reasons (NVML's nvmlClocksEventReason*).
POWER_CAP = 0x4
THERMAL = 0x20 | 0x40  # software and hardware thermal slowdown


def summarize(lines: list[str]) -> dict:
    """The samples' summary; lines are nvidia-smi's `--format=csv,noheader,nounits` rows of
    QUERY (e.g. "1455, 695.68, 0x0000000000000004"). Rows it cannot read are skipped."""
    clocks, power, reasons = [], [], []
    for line in lines:
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3:
            continue
        try:
            clock, watts, reason = int(fields[0]), float(fields[1]), int(fields[2], 16)
        except ValueError:
            continue
        clocks.append(clock)
        power.append(watts)
        reasons.append(reason)
    if not clocks:
        return {"samples": 0, "error": "no readable nvidia-smi samples"}
    n = len(clocks)
    return {
        "samples": n,
        "sm_clock_mhz": {
            "min": min(clocks),
            "median": statistics.median(clocks),
            "max": max(clocks),
        },
        "power_w": {"median": round(statistics.median(power), 1), "max": round(max(power), 1)},
        "power_capped_fraction": round(sum(bool(r & POWER_CAP) for r in reasons) / n, 3),
        "thermal_slowdown_fraction": round(sum(bool(r & THERMAL) for r in reasons) / n, 3),
    }


class GpuSampler:
    """`with GpuSampler(device) as gpu: run()`, then `gpu.summary` (a dict, `summarize`'s,
    or {"error": why} when nothing could be sampled)."""

    def __init__(self, device: torch.device, interval_ms: int = 250) -> None:
        self.device, self.interval_ms = device, interval_ms
        self.proc: subprocess.Popen | None = None
        self.summary: dict = {"error": "not run"}

    def _gpu_id(self) -> str:
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        # By UUID: under CUDA_VISIBLE_DEVICES torch's index is not nvidia-smi's.
        return f"GPU-{uuid}" if uuid is not None else str(index)

    def __enter__(self) -> GpuSampler:
        if self.device.type != "cuda":
            self.summary = {"error": f"no GPU ({self.device.type})"}
            return self
        smi = shutil.which("nvidia-smi")
        if smi is None:
            self.summary = {"error": "nvidia-smi not found"}
            return self
        cmd = [
            smi, "-i", self._gpu_id(), f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
            f"--loop-ms={self.interval_ms}",
        ]  # fmt: skip
        try:
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        except OSError as e:
            self.summary = {"error": f"nvidia-smi did not start: {e}"}
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            out, err = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        self.summary = summarize(out.splitlines())
        if self.summary["samples"] == 0 and err.strip():
            self.summary["error"] = err.strip()[-300:]
