"""Host-to-device copies that never make the host wait for the device.

With async scheduling the host launches step N+1 while step N runs, and the lead only holds if
no call on the way blocks. A `non_blocking` copy from pageable memory does block: CUDA stages
it through a pinned buffer and waits for the stream to reach the copy, so the first of a
step's inputs made the host wait for the whole step ahead, and the device then idled through
the rest of the launch, one small copy, index kernel and graph launch at a time (`bench
breakdown`'s idle gaps at 9b11295 on the H200: 170 / 181 us a step at batch 1 / 256, the
largest between two pageable copies and before the graph's first kernel). From page-locked
memory the copy is queued and the host goes on. PyTorch's pinned-memory cache records the
copy's completion on the block, so a pinned tensor freed right after its copy is not reused
before the copy has run.
"""

from __future__ import annotations

import numpy as np
import torch


def host_tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` as a CPU tensor to be copied to `device`: page-locked when that is a GPU."""
    host = torch.from_numpy(array)
    return host.pin_memory() if device.type == "cuda" else host


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A CPU tensor on `device`, copied without waiting (pinned first for a GPU)."""
    device = torch.device(device)
    if device.type == "cuda" and not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
