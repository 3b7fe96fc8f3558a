"""Python garbage-collector settings for serving (upstream: vllm/utils/gc_utils.py).

After start-up the process holds millions of long-lived objects (torch, transformers, the
model's modules, the engine's state). Every collection of the oldest generation walks all of
them, which stalls a decode step by tens of milliseconds; freezing them into the permanent
generation (`gc.freeze`) leaves collections only the objects the serving loop creates.
"""
from __future__ import annotations

import gc


def freeze_gc_heap() -> int:
    """Collect the young generations, then move every object alive now into the permanent
    generation. Call once the engine is built (weights loaded, KV cache allocated, graphs
    captured). Returns how many objects were frozen.

    Young generations only: a full collection costs ~0.35 s per engine in a long test process
    (CPU CI builds hundreds of engines), and the start-up garbage that matters, the memory
    profile's device tensors, is already collected by the GPU worker (`gc.collect()` around
    profiling). What survives into the old generation stays frozen until shutdown."""
    gc.collect(1)
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze_gc_heap() -> None:
    """Undo freeze_gc_heap: an engine that shuts down inside a longer-lived process (tests,
    notebooks, several engines in one benchmark) returns its frozen objects to the collector,
    so that its reference cycles (and the device memory they hold) can be freed."""
    gc.unfreeze()
