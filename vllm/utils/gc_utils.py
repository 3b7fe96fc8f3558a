"""Python garbage-collector settings for serving (upstream: vllm/utils/gc_utils.py).

After start-up the process holds millions of long-lived objects (torch, transformers, the
model's modules, the engine's state). Every collection of the oldest generation walks all of
them, which stalls a decode step by tens of milliseconds; freezing them into the permanent
generation (`gc.freeze`) leaves collections only the objects the serving loop creates.
"""
from __future__ import annotations

import gc


def freeze_gc_heap() -> int:
    """Collect, then move every object alive now into the permanent generation. Call once the
    engine is built (weights loaded, KV cache allocated, graphs captured). Returns how many
    objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze_gc_heap() -> None:
    """Undo freeze_gc_heap: an engine that shuts down inside a longer-lived process (tests,
    notebooks, several engines in one benchmark) returns its frozen objects to the collector,
    so that its reference cycles (and the device memory they hold) can be freed."""
    gc.unfreeze()
