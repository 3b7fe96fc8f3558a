"""Python garbage collections inside a timed region (a benchmark diagnostic).

Why: the host-bound decode loop pays for every collection it triggers, and a collection of the
oldest generation walks the whole heap (torch, the model's modules, the engine's state: a few
hundred thousand objects; `vllm serve` freezes them, `vllm/utils/gc_utils.py`, an offline
`LLM` does not). The twenty-fifth and twenty-sixth sessions' GPU probe reported 0.24-0.46 ms of
generation-0 collections per B=8 step and ~0 at B=1, while the same benchmark loop on the CPU
collected nothing in 226 timed B=8 steps; so the benchmarks now report what the collector
did in their timed steps, per generation, instead of leaving it to a separate probe.
"""
from __future__ import annotations

import gc
import time


class GcPauses:
    """Context manager: count the collections the interpreter runs while it is entered, and
    the seconds they take, per generation (gc.callbacks)."""

    def __init__(self) -> None:
        self.by_generation: dict[int, list] = {}  # generation -> [collections, seconds]
        self._started: float | None = None

    def __enter__(self) -> "GcPauses":
        if self._callback in gc.callbacks:
            raise RuntimeError("GcPauses is already entered")
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)
        self._started = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:  # a collection that started before __enter__: skip
            tally = self.by_generation.setdefault(int(info["generation"]), [0, 0.0])
            tally[0] += 1
            tally[1] += time.perf_counter() - self._started
            self._started = None

    @property
    def seconds(self) -> float:
        return sum(seconds for _, seconds in self.by_generation.values())

    def summary(self) -> dict[str, list]:
        """{generation: [collections, milliseconds]} (JSON-ready: string keys)."""
        return {str(g): [n, round(s * 1e3, 3)] for g, (n, s) in sorted(self.by_generation.items())}
