"""What the kernels' launch choices read of the device: its SM count, and whether kernels
overlap their neighbours by programmatic dependent launch.

Split-KV attention (paged and MLA) and the skinny GEMM's even row partition size their grids
from the number of SMs. On CPU the kernels run under the Triton interpreter, which has no SMs:
a fixed count keeps every choice deterministic there.

Programmatic dependent launch (PDL, sm_90+; `COMPILE_ENGINE_PDL=1`, off by default): the
decode attention kernel lets the next kernel launch as soon as all its programs run, and the
skinny GEMM, launched as such a dependent, prefetches its weight slice into L2 before it waits
(griddepcontrol.wait) for the attention's output. The weights do not depend on the previous
kernel, so o_proj's 34 MB stream can start while attention, which at batch 1 occupies 8-16 of
the 132 SMs, still runs. Read at launch, so inside a CUDA graph it is fixed at capture.
"""

from __future__ import annotations

import functools
import os

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


PDL_ENV = "COMPILE_ENGINE_PDL"


def pdl_enabled(device: torch.device) -> bool:
    """Whether launches on `device` use programmatic dependent launch (see above)."""
    if os.environ.get(PDL_ENV, "0") != "1" or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_capability(index) >= (9, 0)


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)
