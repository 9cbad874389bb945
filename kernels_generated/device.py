"""What the kernels' launch choices read of the device: its SM count.

Split-KV attention (paged and MLA) and the skinny GEMM's even row partition size their grids
from the number of SMs. On CPU the kernels run under the Triton interpreter, which has no SMs:
a fixed count keeps every choice deterministic there.
"""

from __future__ import annotations

import functools

import torch

CPU_SM_COUNT = 8


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The SMs of a CUDA device (looked up once per device); CPU_SM_COUNT elsewhere."""
    if device.type != "cuda":
        return CPU_SM_COUNT
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
