"""What the kernels' launch choices read of the device: its SM count and compute capability.

Split-KV attention (paged and MLA) and the skinny GEMM's even row partition size their grids
from the number of SMs. On CPU the kernels run under the Triton interpreter, which has no SMs:
a fixed count keeps every choice deterministic there. Whether a launch uses programmatic
dependent launch is the kernel config's choice (kernels_generated/tuning.py); `pdl_on` applies
it to a device and a launch size.
"""

from __future__ import annotations

import functools

import torch

from compile_engine.kernels_generated.tuning import KernelConfig

CPU_SM_COUNT = 8


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The SMs of a CUDA device (looked up once per device); CPU_SM_COUNT elsewhere."""
    if device.type != "cuda":
        return CPU_SM_COUNT
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_on(config: KernelConfig, device: torch.device, rows: int) -> bool:
    """Whether a launch of `rows` tokens on `device` is a PDL dependent: the config has PDL on,
    the launch has at most `pdl_max_rows` tokens, and the device is sm_90 or newer. Such a
    kernel waits (gdc_wait) before it touches memory and releases the next kernel after its
    main loop (tuning.py)."""
    if not config.pdl or rows > config.pdl_max_rows or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_capability(index) >= (9, 0)


def pdl_launch(enabled: bool) -> dict:
    """A kernel launch's options when the kernel is a PDL dependent: it may start before the
    kernel ahead of it ends, so it must wait (gdc_wait) before it touches their memory."""
    return {"launch_pdl": True} if enabled else {}
