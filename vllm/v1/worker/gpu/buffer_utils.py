"""CpuGpuBuffer: a persistent device buffer with a pinned host twin (vLLM's CpuGpuBuffer pattern).

The host side is a numpy view of pinned memory, so planners fill it with plain numpy and one
`copy_to_gpu(n)` moves the live prefix to the device without a host sync (non_blocking from pinned
memory). Both sides are allocated once: CUDA graphs capture the device address, and metadata hands
out views of either side.

Reuse rule: a pinned region must not be rewritten before the copy that reads it has run. The runner
writes each twin once per step and synchronises once per step (the sampled-token transfer), so a
twin written at step N+1 was last read by a copy of step N, which that sync has retired.
"""
from __future__ import annotations

import torch


def _pin_ok(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


class CpuGpuBuffer:
    def __init__(self, *shape: int, dtype: torch.dtype, device: torch.device | str,
                 fill: int | float = 0):
        self.device = torch.device(device)
        self.cpu = torch.full(shape, fill, dtype=dtype, pin_memory=_pin_ok(self.device))
        self.np = self.cpu.numpy()
        # On a CPU run the "device" buffer is a separate tensor as well, so both paths behave the
        # same (callers never rely on the twins aliasing).
        self.gpu = torch.full(shape, fill, dtype=dtype, device=self.device)

    def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
        """Copy the first `n` rows (all when None) host -> device; returns the device view."""
        if n is None:
            self.gpu.copy_(self.cpu, non_blocking=True)
            return self.gpu
        self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.gpu[:n]
