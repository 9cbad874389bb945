"""Are a decode step's idle gaps (`bench breakdown`'s idle_gaps) the copy engine's turnaround
and the graph launch's own start, with the host not late? Everything below is queued behind
~10 ms of device work (torch.cuda._sleep), so no gap can come from the host: 11 small
host-to-device copies from pageable memory, the same from pinned memory, and one packed copy,
each followed by a kernel and a 400-kernel CUDA graph; prints each variant's idle time an
iteration and the largest gaps by the kernels around them. Run at 56664d2 on the H200: idle
58.7 / 65.7 / 50.2 us an iteration (pageable / pinned / packed), ~39 us of each between the
400 graph kernels (elementwise -> elementwise: their boundaries and the graph's start, not told
apart here), 15.1 / 17.8 us between the 11 copies (docs/compiler.md, item 9 of the dropped
list). On the device, after decode_bench.sh's wheel install line (carry [".whl"]):
    python3 scripts/device/gap_probe.py
"""

import torch
from torch.profiler import ProfilerActivity, profile

from compile_engine.benchmarks.breakdown import critical_path, is_device_event

dev = "cuda"
host = [torch.arange(64 * (i + 1), dtype=torch.int32) for i in range(11)]
pinned = [h.pin_memory() for h in host]
devs = [torch.empty_like(h, device=dev) for h in host]
packed_h = torch.cat(host).pin_memory()
packed_d = torch.empty_like(packed_h, device=dev)
x = torch.zeros(1024, device=dev)
g = torch.cuda.CUDAGraph()
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(3):
        x.add_(1)
    with torch.cuda.graph(g, stream=s):
        for _ in range(400):
            x.add_(1)
torch.cuda.current_stream().wait_stream(s)
torch.cuda.synchronize()


def run(kind):
    torch.cuda._sleep(20_000_000)  # queue everything below behind ~10 ms of device work
    if kind == "packed":
        packed_d.copy_(packed_h, non_blocking=True)
    else:
        for h, d in zip(host if kind == "pageable" else pinned, devs, strict=True):
            d.copy_(h, non_blocking=True)
    x.mul_(1.0)
    g.replay()


cuda = torch.autograd.DeviceType.CUDA
for kind in ("pageable", "pinned", "packed"):
    for _ in range(3):
        run(kind)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            run(kind)
        torch.cuda.synchronize()
    ev = [
        (e.time_range.start, e.time_range.end, e.name[:40])
        for e in p.events()
        if getattr(e, "device_type", None) == cuda and is_device_event(e.name, cuda)
    ]
    # Per iteration: from the first copy to the graph's last kernel.
    _, idle, gaps = critical_path(ev)
    top = sorted(gaps.items(), key=lambda kv: -kv[1])[:4]
    print(f"== {kind}: idle {idle / 5:.1f} us an iteration (sleep kernel ahead included)")
    for (a, b), us in top:
        print(f"   {us / 5:7.1f} us  {a} -> {b}")
