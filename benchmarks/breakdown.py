"""`bench breakdown`: where one decode step's time goes (issue 7).

Times each phase of `LLMEngine.step()` on the host, with no extra synchronisation (async
scheduling keeps one step in flight, and a synchronize per step would undo that overlap), and
separately the device time of the model alone (CUDA-graph replay, timed with CUDA events).
"collect" is mostly the host waiting for the device (the sampled tokens' event): when it is a
large share of the step, the step is device-bound and host work is hidden behind it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

import torch

from compile_engine.benchmarks.common import (
    add_engine_flags,
    engine_kwargs,
    engine_settings,
    random_prompts,
)
from compile_engine.benchmarks.results import write_result
from compile_engine.runtime.llm import OFFLINE_MAX_NUM_BATCHED_TOKENS


def _timed(table: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            table[name].append(time.perf_counter() - start)

    return wrapper


# Device kernels by what they do, matched on their names (first match wins).
_KERNEL_KINDS = (
    ("attention", ("paged_attention", "reduce_splits", "mla_")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "splitk", "cublas")),
    ("rotary", ("rotary",)),
    ("elementwise (our kernels)", ("silu_and_mul", "rms_norm")),
    ("sampling", ("argmax", "reduce_kernel", "softmax", "topk", "sort")),
    ("copies", ("memcpy", "memset")),
    ("fused elementwise (Inductor)", ("triton_",)),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, keys in _KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def is_device_event(name: str, device_type=None) -> bool:
    """A kernel, memcpy or memset, not a CPU-side op or annotation that launched it. The step
    annotation goes by its name: torch 2.11 with CUDA 13 reports it as a device event too,
    spanning the step's kernels (at 57cd701 it doubled the device total)."""
    if name.startswith("aten::") or name.startswith("ProfilerStep"):
        return False
    return device_type is None or device_type == torch.autograd.DeviceType.CUDA


def critical_path(
    intervals: list[tuple[float, float, str]],
) -> tuple[dict[str, float], float, dict[tuple[str, str], float]]:
    """({label: time}, idle, {(label before, label after): idle}) of device intervals (start,
    end, label) of one window: how far each label's kernels moved the device's finish line, the
    time no kernel ran, and that idle time by the pair of kernels around each gap. With
    programmatic dependent launch a kernel starts before the one ahead of it ends and waits,
    so its own duration counts time the kernel ahead already counts; here a kernel is charged
    only for the stretch after every earlier-starting kernel has ended. The labels and the
    idle time add up to the window's span (first start to last end)."""
    advance: dict[str, float] = defaultdict(float)
    gaps: dict[tuple[str, str], float] = defaultdict(float)
    idle = 0.0
    frontier, last = None, ""
    for start, end, label in sorted(intervals):
        if frontier is None:
            frontier = start
        if start > frontier:
            idle += start - frontier
            gaps[last, label] += start - frontier
            frontier = start
        if end > frontier:
            advance[label] += end - frontier
            frontier, last = end, label
    return dict(advance), idle, dict(gaps)


def layer_positions(intervals: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The intervals relabelled by their place in a layer: '<name> #k', k the kernel's count
    among same-named kernels since the last attention kernel (which keeps its name). One
    kernel serves several roles (at batch 1 the skinny GEMM runs o_proj #0, gate_up #1,
    down #2 and the next layer's qkv #3), so its name alone cannot say which role costs what.
    Kernels before the window's first attention kernel count from 0 as well (the first step's
    first qkv)."""
    seen: dict[str, int] = defaultdict(int)
    out = []
    for start, end, name in sorted(intervals):
        if kernel_kind(name) == "attention":
            seen.clear()
            out.append((start, end, name))
            continue
        out.append((start, end, f"{name} #{seen[name]}"))
        seen[name] += 1
    return out


def layer_timeline(positions: list[tuple[float, float, str]], layer: int) -> list[dict]:
    """The kernels from the `layer`-th attention kernel of the window to the next one, each
    with its start and end in us from that attention kernel's start (a kernel that starts
    before the one ahead of it ends was launched early, by PDL, and waited)."""
    attention = [
        i for i, (_, _, label) in enumerate(positions) if kernel_kind(label) == "attention"
    ]
    if len(attention) < layer + 2:
        return []
    first, last = attention[layer], attention[layer + 1]
    origin = positions[first][0]
    return [
        {
            "kernel": label[:90],
            "start_us": round(start - origin, 2),
            "end_us": round(end - origin, 2),
        }
        for start, end, label in positions[first : last + 1]
    ]


def kernel_table(engine, steps: int, top: int = 30) -> dict:
    """Device time a step by kind of kernel and the top kernels, from torch.profiler over
    `steps` engine steps. Two warm-up steps come first (CUPTI drops the first kernels it sees:
    a profile without them counted 6 of 8 steps), and the device is drained at both ends of
    the window, so it holds exactly the kernels of the steps launched inside it."""
    from torch.profiler import ProfilerActivity, profile, schedule

    warmup = 2
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
        schedule=schedule(wait=0, warmup=warmup, active=steps, repeat=1),
    ) as prof:
        for i in range(warmup + steps):
            engine.step()
            if i in (warmup - 1, warmup + steps - 1):
                torch.cuda.synchronize()
            prof.step()
    kinds: dict[str, float] = defaultdict(float)
    kernels = []
    for e in prof.key_averages():
        us = e.self_device_time_total / steps
        # Device events only: a CPU op (aten::mm) or the step annotation carries the device
        # time of what it launched as its own, which would count those kernels twice.
        if us <= 0 or not is_device_event(e.key, getattr(e, "device_type", None)):
            continue
        kinds[kernel_kind(e.key)] += us
        kernels.append((us, e.count / steps, e.key))
    kernels.sort(reverse=True)
    cuda = torch.autograd.DeviceType.CUDA
    events = [
        e
        for e in prof.events()
        if getattr(e, "device_type", None) == cuda and is_device_event(e.name, cuda)
    ]
    # One pass by kernel name: its charges summed by kind below, its idle time by the kernels
    # on either side of each gap (a late host, or the start-up of a copy or a graph launch
    # queued in time: docs/compiler.md, item 9 of the dropped list).
    intervals = [(e.time_range.start, e.time_range.end, e.name) for e in events]
    by_name, idle, gaps = critical_path(intervals)
    positions = layer_positions(intervals)
    by_position, _, _ = critical_path(positions)
    position_calls: dict[str, int] = defaultdict(int)
    for _, _, label in positions:
        position_calls[label] += 1
    advance: dict[str, float] = defaultdict(float)
    for name, us in by_name.items():
        advance[kernel_kind(name)] += us
    short: dict[tuple[str, str], float] = defaultdict(float)  # names cut to 60 as printed
    for (before, after), us in gaps.items():
        short[before[:60], after[:60]] += us
    top_gaps = sorted(short.items(), key=lambda kv: -kv[1])[:8]
    return {
        "device_us_per_step": round(sum(kinds.values()), 1),
        "by_kind_us": {k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        # The same window charged by critical_path: what each kind adds to the step's device
        # time once overlaps are taken out, and the time the device ran no kernel.
        "critical_path_us": {
            k: round(v / steps, 1) for k, v in sorted(advance.items(), key=lambda kv: -kv[1])
        },
        "device_idle_us_per_step": round(idle / steps, 1),
        "idle_gaps": [
            {"after": before, "before": after, "us_per_step": round(us / steps, 1)}
            for (before, after), us in top_gaps
        ],
        # One layer mid-step, kernel by kernel (the window's 16th attention kernel on).
        "layer_timeline": layer_timeline(positions, 16),
        # The critical path again, each kernel by its place in a layer (layer_positions).
        "critical_path_by_position": [
            {
                "kernel": label[:90],
                "calls_per_step": round(position_calls[label] / steps, 2),
                "us_per_step": round(us / steps, 1),
                "us_per_call": round(us / position_calls[label], 2),
            }
            for label, us in sorted(by_position.items(), key=lambda kv: -kv[1])[:top]
        ],
        "top_kernels": [
            {"name": name[:90], "us_per_step": round(us, 1), "calls_per_step": round(calls, 2)}
            for us, calls, name in kernels[:top]
        ],
    }


def breakdown(
    llm, batch: int, steps: int, input_len: int, rng_seed: int = 0, kernels: bool = False
) -> dict:
    import random

    from compile_engine.runtime.sampling_params import SamplingParams

    engine = llm.engine
    vocab = engine.model_config.vocab_size
    prompts = random_prompts(batch, input_len, vocab, random.Random(rng_seed))
    params = SamplingParams(
        temperature=0, max_tokens=steps + 24, ignore_eos=True
    )  # + the kernel profile
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()  # prefill
    phases: dict[str, list[float]] = defaultdict(list)
    sched, runner = engine.scheduler, engine.runner
    originals = (
        sched.schedule,
        runner.prepare,
        runner._run_model,
        runner.collect,
        sched.update_from_output,
    )
    sched.schedule = _timed(phases, "schedule", sched.schedule)
    runner.prepare = _timed(phases, "prepare inputs", runner.prepare)
    runner._run_model = _timed(phases, "model launch (host)", runner._run_model)
    runner.collect = _timed(phases, "collect (waits for the device)", runner.collect)
    sched.update_from_output = _timed(phases, "scheduler update", sched.update_from_output)
    step_times = []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - start)
    finally:
        (
            sched.schedule,
            runner.prepare,
            runner._run_model,
            runner.collect,
            sched.update_from_output,
        ) = originals
    table = kernel_table(engine, min(steps, 8)) if kernels and torch.cuda.is_available() else None
    for i in range(batch):
        engine.abort_request(f"b{i}")
    step = statistics.median(step_times)
    rows = {name: statistics.median(v) for name, v in phases.items()}
    rows["logits, sampling launch, detokenize (rest)"] = step - sum(rows.values())
    device_ms = None
    graphs = runner.graphs
    if graphs is not None and graphs.last_key is not None:
        graph = graphs.graphs[graphs.last_key]  # the last step's (a short-context one or not)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        device_ms = start.elapsed_time(end) / 20
    return {
        "batch": batch,
        "step_ms": round(step * 1e3, 3),
        "phases_ms": {k: round(v * 1e3, 3) for k, v in rows.items()},
        "model_device_ms": round(device_ms, 3) if device_ms is not None else None,
        "kernels": table,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench breakdown", description=__doc__.splitlines()[0])
    add_engine_flags(p, max_num_batched_tokens=OFFLINE_MAX_NUM_BATCHED_TOKENS)  # as latency
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument(
        "--kernels", action="store_true", help="also profile device time by kernel (CUDA)"
    )
    args = p.parse_args(argv)
    from compile_engine.runtime.llm import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    results = [
        breakdown(llm, int(b), args.steps, args.input_len, kernels=args.kernels)
        for b in args.batch_sizes.split(",")
    ]
    for r in results:
        print(
            f"batch {r['batch']}: step {r['step_ms']:.2f} ms, model on device "
            f"{r['model_device_ms']} ms"
        )
        for name, ms in r["phases_ms"].items():
            print(f"  {name:<36}{ms:8.3f} ms")
        if r["kernels"]:
            k = r["kernels"]
            print(f"  device kernels {k['device_us_per_step']:.0f} us a step:")
            for kind, us in k["by_kind_us"].items():
                print(f"    {kind:<34}{us:8.1f} us")
            print("  on the critical path (overlaps taken out):")
            for kind, us in k["critical_path_us"].items():
                print(f"    {kind:<34}{us:8.1f} us")
            print(f"    {'device idle (no kernel)':<34}{k['device_idle_us_per_step']:8.1f} us")
            for gap in k["idle_gaps"]:
                print(f"      {gap['us_per_step']:8.1f} us  {gap['after']} -> {gap['before']}")
            for row in k["top_kernels"]:
                print(f"    {row['us_per_step']:8.1f} us x{row['calls_per_step']:<6} {row['name']}")
            print("  one layer, us from its attention kernel's start:")
            for row in k.get("layer_timeline", []):
                print(f"    {row['start_us']:8.2f} .. {row['end_us']:8.2f}  {row['kernel']}")
            print(
                "  on the critical path by place in a layer (#k: k-th of its name after attention):"
            )
            for row in k["critical_path_by_position"][:12]:
                print(
                    f"    {row['us_per_step']:8.1f} us x{row['calls_per_step']:<6} "
                    f"{row['us_per_call']:6.2f} us a call  {row['kernel']}"
                )
    path = write_result(
        "breakdown",
        {"settings": engine_settings(llm), "results": results},
        directory=args.results_dir,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
