"""Small host arrays uploaded to new device tensors through a ring of page-locked buffers.

Why: `tensor.pin_memory()` allocates page-locked memory on every call (cudaHostAlloc, tens to
hundreds of microseconds of host time), and a non-blocking copy from pageable memory makes the
host wait for the stream. The FlashInfer plan bookkeeping uploads a few KB per new plan (a
host-written plan's values, a skeleton's index arrays), in steps that are otherwise host-bound,
so those go through here: the bytes are written into the next buffer of a ring kept for the
process, copied to a fresh device tensor without blocking, and the buffer is reused once the
event recorded after its copy has completed (with `depth` buffers that is long done in steady
decode; otherwise the host waits for it, never for anything later on the stream).
"""
from __future__ import annotations

import numpy as np
import torch

from vllm.utils.cuda_streams import record_event


class PinnedUploader:
    def __init__(self, device: torch.device, depth: int = 8, min_bytes: int = 1 << 16):
        self.device = torch.device(device)
        self.depth = depth
        self.min_bytes = min_bytes
        self._buffers: list[torch.Tensor | None] = [None] * depth
        self._events: list = [None] * depth
        self._next = 0
        self.uploads = 0
        self.waits = 0  # uploads that found their buffer's last copy still pending
        self._captured_sources: list[torch.Tensor] = []

    def upload(self, array: np.ndarray) -> torch.Tensor:
        """A new device tensor holding `array` (stream-ordered: kernels enqueued after this on
        the current stream see it)."""
        array = np.ascontiguousarray(array)
        if self.device.type != "cuda":
            return torch.from_numpy(array.copy())
        if torch.cuda.is_current_stream_capturing():
            # A captured copy reads its source again at every replay: give it a page-locked
            # source of its own, kept for the process, not a ring buffer rewritten later.
            source = torch.from_numpy(array.copy()).pin_memory()
            self._captured_sources.append(source)
            out = torch.empty(source.shape, dtype=source.dtype, device=self.device)
            out.copy_(source, non_blocking=True)
            return out
        i = self._next
        self._next = (i + 1) % self.depth
        event = self._events[i]
        if event is not None and not event.query():
            self.waits += 1
            event.synchronize()
        buffer = self._buffers[i]
        if buffer is None or buffer.numel() < array.nbytes:
            size = max(self.min_bytes, 1 << max(array.nbytes - 1, 1).bit_length())
            buffer = self._buffers[i] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        host = torch.from_numpy(array)
        staged = buffer[:array.nbytes].view(host.dtype).view(host.shape)
        staged.copy_(host)
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        out.copy_(staged, non_blocking=True)
        if event is None:
            event = self._events[i] = torch.cuda.Event()
        record_event(event)
        self.uploads += 1
        return out


_UPLOADERS: dict[torch.device, PinnedUploader] = {}


def upload(array: np.ndarray, device) -> torch.Tensor:
    """`array` on `device` through the process's ring for that device (see the module)."""
    device = torch.device(device)
    uploader = _UPLOADERS.get(device)
    if uploader is None:
        uploader = _UPLOADERS[device] = PinnedUploader(device)
    return uploader.upload(array)
