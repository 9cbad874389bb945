"""Arrival counters for kernels whose last program to finish a piece of work combines it.

The split-KV paged attention and the split-K skinny GEMM both end the same way: each program
of a split writes its partial, then counts itself in on the piece's int32 counter
(`tl.atomic_add`); the one that arrives last combines the partials and puts the counter back
to zero. So the counters are zero between launches and one buffer per kernel and device
serves every launch, captured in a CUDA graph or not, with no memset. The buffer must exist
before a capture (an allocation inside one would be the graph's, freed with it): the first
call of a kernel on a device has to be eager, as the engine's warm-up is.
"""

from __future__ import annotations

import torch
from torch import Tensor

# (kernel, device) -> its counters; tests read it to check the counters came back to zero.
ALLOCATED: dict[tuple[str, torch.device], Tensor] = {}


def arrival_counters(
    kernel: str, device: torch.device, size: int, error: type[Exception]
) -> Tensor:
    """`kernel`'s zeroed int32 counters on `device`, at least `size` of them; allocated (or
    grown) on first need, which inside a CUDA-graph capture raises `error`."""
    counters = ALLOCATED.get((kernel, device))
    if counters is None or counters.numel() < size:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise error(
                f"{kernel} needs {size} arrival counters allocated before CUDA-graph capture: "
                "run the same call once outside the capture first (a warm-up)"
            )
        counters = torch.zeros(size, dtype=torch.int32, device=device)
        ALLOCATED[(kernel, device)] = counters
    return counters
