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
import triton
import triton.language as tl
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


@triton.jit
def store_split(acc, o_offs, p_offs, o_mask, out_ptr, ws_ptr, counter_ptr, plane, split_k,
                pid_k, tile):  # fmt: skip
    """A split-K GEMM's end: with one split, `acc` (float32, any layout) rounded to the
    output's dtype at `o_offs`; else this split's partial at `p_offs` of its `plane`-sized
    workspace slice, counted in on `tile`'s counter, and the last to arrive sums the partials
    in split order (deterministic), stores them and zeroes the counter."""
    out_dtype = out_ptr.dtype.element_ty
    if split_k == 1:
        tl.store(out_ptr + o_offs, acc.to(out_dtype), mask=o_mask)
    else:
        tl.store(ws_ptr + pid_k * plane + p_offs, acc, mask=o_mask)
        # Every thread's partial is stored before the one thread that does the atomic
        # publishes it (release at GPU scope); the last arrival acquires the others'.
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
        if arrived == split_k - 1:
            total = tl.zeros_like(acc)
            for s in range(0, split_k):
                # .cg: read from L2, where the other SMs' partials are, never a stale L1 line.
                total += tl.load(
                    ws_ptr + s * plane + p_offs, mask=o_mask, other=0.0, cache_modifier=".cg"
                )
            tl.store(out_ptr + o_offs, total.to(out_dtype), mask=o_mask)
            tl.atomic_xchg(counter_ptr + tile, 0)
