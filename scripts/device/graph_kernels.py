"""Which kernels one replay of each small CUDA graph runs, and for how long (torch.profiler
over replays of the engine's captured graphs): where a step of a few tokens spends its device
time. Issue 33: on the H200 SmolLM2's graphs of 2-16 tokens replayed in ~1,450 us against
~905 us at one token (aa30b45), which makes a verification step cost twice a decode step.

    python3 scripts/device/graph_kernels.py MODEL [SIZE ...]    (default sizes 1 2 8)

Also each graph's wall time a replay (CUDA events over back-to-back replays, the sizes timed
in turn twice), and with TRACE_DIR set, a Chrome trace of three replays of each graph there
(gzipped): the gaps between kernels that the kernel sums do not show.
"""

from __future__ import annotations

import gzip
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from compile_engine import LLM, SamplingParams

REPLAYS = 20


def main() -> None:
    model, sizes = sys.argv[1], [int(s) for s in sys.argv[2:]] or [1, 2, 8]
    llm = LLM(model, target="h100", max_model_len=2048, max_num_seqs=16)
    llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0))
    graphs = llm.engine.runner.graphs
    keys = sorted((k for k in graphs.graphs if k[0] in sizes), key=str)
    walls: dict = {key: [] for key in keys}
    for order in (keys, keys[::-1]):
        for key in order:
            walls[key].append(wall_us(graphs.graphs[key]))
    for key in keys:
        print(f"== graph {key}: wall {' / '.join(f'{w:.1f}' for w in walls[key])} us a replay")
    trace_dir = os.environ.get("TRACE_DIR")
    for key in keys:
        graph = graphs.graphs[key]
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(REPLAYS):
                graph.replay()
            torch.cuda.synchronize()
        rows = [e for e in prof.key_averages() if e.device_time_total > 0]
        total = sum(e.device_time_total for e in rows) / REPLAYS
        print(f"== graph {key}: {total:.1f} us of kernels a replay, {len(rows)} kinds")
        for e in sorted(rows, key=lambda e: -e.device_time_total)[:14]:
            calls = e.count // REPLAYS
            us = e.device_time_total / REPLAYS
            print(f"  {us:8.1f} us  {calls:4d} calls  {e.key[:110]}")
        if trace_dir:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    graph.replay()
                torch.cuda.synchronize()
            name = os.path.join(trace_dir, "trace-" + "-".join(map(str, key)) + ".json")
            prof.export_chrome_trace(name)
            with open(name, "rb") as raw, gzip.open(name + ".gz", "wb") as packed:
                packed.write(raw.read())
            os.remove(name)


def wall_us(graph, replays: int = 50) -> float:
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays * 1000


if __name__ == "__main__":
    main()
