"""The current CUDA stream without `torch.cuda.current_stream()`'s Python cost, for event records
on the decode step's host path.

Why: `torch.cuda.Event.record()` with no stream calls `torch.cuda.current_stream()`, which
resolves the device index through several Python helpers and builds a new `Stream` object on
every call. In a cProfile of 150 DSpark steps on the H100 (seventeenth session) those
`current_stream` calls were ~85 % of `Event.record`'s time, 3.8 calls a step; a plain decode
step records 2-3 events (its inputs, its output copy, the FlashInfer staging ring).

`current_stream()` asks the C API for the current stream of the current device (two C calls)
and returns one cached `Stream` wrapper per distinct (stream id, device, type): the same stream
that `torch.cuda.current_stream()` names, also inside `torch.cuda.stream(...)` contexts, since
the lookup is made at every call and only the Python object is reused.
"""
from __future__ import annotations

import torch

_WRAPPERS: dict[tuple, torch.cuda.Stream] = {}


def _lookup() -> tuple | None:
    c = torch._C
    get_device = getattr(c, "_cuda_getDevice", None)
    get_stream = getattr(c, "_cuda_getCurrentStream", None)
    if get_device is None or get_stream is None:  # another torch build: the public path
        return None
    return tuple(get_stream(get_device()))


def current_stream() -> torch.cuda.Stream:
    """torch.cuda.current_stream() of the current device, its Python wrapper cached."""
    data = _lookup()
    if data is None:
        return torch.cuda.current_stream()
    stream = _WRAPPERS.get(data)
    if stream is None:
        stream = _WRAPPERS[data] = torch.cuda.Stream(stream_id=data[0], device_index=data[1],
                                                     device_type=data[2])
    return stream


def record_event(event: torch.cuda.Event) -> None:
    """event.record() on the current stream (see the module doc for why not the plain call)."""
    event.record(current_stream())
