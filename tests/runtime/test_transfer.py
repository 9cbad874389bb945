"""runtime/transfer.py: per-step host-to-device copies that never make the host wait."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.transfer import host_tensor, to_device

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cpu_destination_keeps_the_array_and_copies_nothing():
    array = np.arange(6, dtype=np.int64)
    host = host_tensor(array, torch.device("cpu"))
    array[0] = 42  # from_numpy: the tensor is the array's memory, not a copy
    assert host[0].item() == 42 and not host.is_pinned()
    assert torch.equal(to_device(host, "cpu"), host)


@pytest.mark.gpu
@requires_cuda
def test_gpu_copies_are_pinned_and_leave_the_host_free():
    device = torch.device("cuda")
    array = np.arange(1000, dtype=np.int32)
    assert host_tensor(array, device).is_pinned()
    pageable = torch.arange(1000, dtype=torch.int32)
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of device work queued ahead of the copies
    copied = to_device(pageable, device)
    pinned = to_device(host_tensor(array, device), device)
    # Still busy: neither call waited for the kernel ahead (a copy from pageable memory does).
    assert not stream.query()
    torch.cuda.synchronize()
    assert torch.equal(copied.cpu(), pageable) and torch.equal(
        pinned.cpu(), torch.from_numpy(array)
    )
