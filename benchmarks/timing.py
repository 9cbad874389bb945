"""Timing for the kernel harness (benchmarks/kernel_harness.py), `bench fusions`, `bench moe`
and `bench offline-floor`: CUDA-graph replay.

A fusion kernel runs for microseconds, less than one Python launch of a custom op, so eager
timing measures the host. The engine replays whole-model CUDA graphs, so a kernel is timed the
same way: `fn` captured many times back to back in one graph, the graph replayed, the median
per call kept. Inputs stay the same across calls, so anything under the L2 size (60 MB on the
H200) is read from L2, as a layer's activations mostly are in the model too.
"""

from __future__ import annotations

from collections.abc import Callable


def graph_us(fn: Callable[[], object], rep_ms: int = 20) -> float:
    """Median microseconds of one `fn()` replayed from a CUDA graph (triton.testing's
    do_bench_cudagraph: as many calls as fill `rep_ms`, ten replays)."""
    import torch
    from triton.testing import do_bench_cudagraph

    fn()  # compile and autotune outside the capture
    # do_bench_cudagraph runs on a stream of its own that waits for nothing: inputs still being
    # made on this stream (a MoE layer's 400 MB of experts) would be read unwritten.
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3


def warm_up(fn: Callable[[], object], calls: int = 3) -> None:
    """`calls` calls of `fn` on a side stream, so lazy initialisation (kernel loads, cuBLAS
    handles) stays out of any capture that follows."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(calls):
            fn()
    torch.cuda.current_stream().wait_stream(side)


def captured(fn: Callable[[], object]) -> Callable[[], None]:
    """One call of `fn` captured in a CUDA graph (after `warm_up`, which the caller runs); the
    replay it returns keeps `fn`, and so the tensors its closure holds and the graph reads and
    writes, alive."""
    import torch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def replay() -> None:
        graph.replay()

    replay.captured = fn
    return replay


def event_seconds(
    fn: Callable[[], object],
    *,
    cuda_graph: bool = False,
    warmup: int = 3,
    iters: int = 20,
    inner: int = 10,
) -> float:
    """Median seconds per `fn()` on CUDA: `warmup` calls on a side stream (lazy initialisation
    stays out of any capture), then `iters` samples of `inner` back-to-back calls between two
    CUDA events. cuda_graph=True captures one call and replays it, as the engine runs decode:
    eager timing of a small kernel measures Python launch overhead, not the kernel."""
    import torch

    warm_up(fn, warmup)
    call = captured(fn) if cuda_graph else fn
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return sorted(times)[len(times) // 2]
