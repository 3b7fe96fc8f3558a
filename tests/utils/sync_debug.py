"""The one device->host transfer a decode step may make, exempted from
`torch.cuda.set_sync_debug_mode("error")` in the sync-budget tests."""
from __future__ import annotations

import torch


def exempt_from_sync_debug(fn, calls: list):
    """fn wrapped to run with sync debug mode off; every call appends 1 to `calls` (so a test
    can count the exempted transfers per step)."""
    def exempt(*args, **kwargs):
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            calls.append(1)
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(mode)
    return exempt
