"""Where and how long the host blocks on the GPU, by call site (a benchmark diagnostic).

The decode path's host waits are all CUDA event synchronizations (the sync budget allows no
other): the step output's event, the previous step's input copies before pinned twins are
rewritten (GPUModelRunner._retire_previous_step), a pinned staging ring whose next buffer the
GPU has not read yet. `HostWaits` wraps `synchronize` of an event class (default
torch.cuda.Event) while it is entered and sums, per calling function, the calls and the
seconds spent inside. Why: an async engine's step time is set by whichever side waits; a
change that makes the host faster (lean Triton launches) and the engine slower at B=8 should
show up here as the host blocking somewhere new (scripts/ab_lean_launch.py --host-waits).
"""
from __future__ import annotations

import sys
import time
from typing import Any


class HostWaits:
    """Context manager: time every `event_cls.synchronize` call made while entered."""

    def __init__(self, event_cls: Any = None):
        if event_cls is None:
            import torch
            event_cls = torch.cuda.Event
        self.event_cls = event_cls
        self.sites: dict[str, list] = {}  # "file:line(function)" -> [calls, seconds]
        self._original = None

    def __enter__(self) -> "HostWaits":
        if self._original is not None:
            raise RuntimeError("HostWaits is already entered")
        original = self._original = self.event_cls.synchronize
        sites = self.sites

        def synchronize(event, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(event, *args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                frame = sys._getframe(1)
                code = frame.f_code
                path = code.co_filename
                key = (f"{path.split('/vllm/')[-1] if '/vllm/' in path else path}:"
                       f"{frame.f_lineno}({code.co_name})")
                entry = sites.get(key)
                if entry is None:
                    entry = sites[key] = [0, 0.0]
                entry[0] += 1
                entry[1] += spent

        self.event_cls.synchronize = synchronize
        return self

    def __exit__(self, *exc) -> None:
        self.event_cls.synchronize = self._original
        self._original = None

    def snapshot(self) -> dict[str, tuple[int, float]]:
        """{call site: (calls, seconds)} so far."""
        return {site: (calls, seconds) for site, (calls, seconds) in self.sites.items()}

    def per_step(self, steps: int, top: int = 6) -> list[tuple[str, float, float]]:
        """The `top` call sites by time: (site, calls per step, ms per step)."""
        if steps <= 0:
            raise ValueError(f"steps={steps} must be positive")
        rows = sorted(self.sites.items(), key=lambda item: -item[1][1])[:top]
        return [(site, calls / steps, seconds * 1e3 / steps) for site, (calls, seconds) in rows]
