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


def is_decode_only(scheduler_output) -> bool:
    """A step of running requests only (no new request's prefill), with something to do."""
    return (not scheduler_output.scheduled_new_reqs
            and scheduler_output.total_num_scheduled_tokens > 0)


def run_under_sync_debug(execute, scheduler_output, transfers: list):
    """execute(scheduler_output) with torch.cuda.set_sync_debug_mode("error") (any other host
    sync raises); asserts that it made exactly one exempted transfer (`transfers`, the list
    given to exempt_from_sync_debug) and returns its output."""
    before = len(transfers)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = execute(scheduler_output)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(transfers) - before == 1, f"{len(transfers) - before} exempted transfers"
    return out
