"""Python garbage-collector settings for serving (upstream: vllm/utils/gc_utils.py).

After start-up the process holds millions of long-lived objects (torch, transformers, the
model's modules, the engine's state). Every collection of the oldest generation walks all of
them, which stalls a decode step by tens of milliseconds; freezing them into the permanent
generation (`gc.freeze`) leaves collections only the objects the serving loop creates.
"""
from __future__ import annotations

import gc


def freeze_gc_heap() -> int:
    """Collect, then move every object alive now into the permanent generation. The API server
    calls it once its engine is built and its app is ready, just before it serves (a process
    that lives for one engine). Returns how many objects were frozen.

    Not in every LLMEngine: a process that builds and drops many engines (tests, notebooks)
    would keep a dropped engine's reference cycles, and with them its worker processes and
    device memory, out of the collector's reach until some shutdown unfroze them."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze_gc_heap() -> None:
    """Undo freeze_gc_heap when serving ends (the server may run inside a longer-lived
    process), so that the engine's reference cycles can be collected after its shutdown."""
    gc.unfreeze()
