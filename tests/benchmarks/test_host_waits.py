"""vllm/benchmarks/host_waits.py: event waits are counted and timed per call site while the
timer is entered, and only then."""
import time

import pytest

from vllm.benchmarks.host_waits import HostWaits


class _Event:
    """Stands in for torch.cuda.Event: synchronize blocks for `delay` seconds."""

    def __init__(self, delay: float):
        self.delay = delay
        self.waited = 0

    def synchronize(self):
        time.sleep(self.delay)
        self.waited += 1


def _output_wait(event):
    event.synchronize()


def _ring_wait(event):
    event.synchronize()


def test_waits_are_counted_and_timed_by_call_site_only_while_entered():
    slow, fast = _Event(0.004), _Event(0.0)
    original = _Event.synchronize
    _output_wait(slow)  # before: not counted
    with HostWaits(_Event) as waits:
        for _ in range(3):
            _output_wait(slow)
        _ring_wait(fast)
    _ring_wait(fast)  # after: not counted
    assert _Event.synchronize is original
    assert slow.waited == 4 and fast.waited == 2  # the events still synchronized
    sites = waits.snapshot()
    assert len(sites) == 2
    (out_site, (out_calls, out_s)), = [(k, v) for k, v in sites.items() if "_output_wait" in k]
    (ring_site, (ring_calls, ring_s)), = [(k, v) for k, v in sites.items() if "_ring_wait" in k]
    assert out_site.startswith(__file__.split("/vllm/")[-1] if "/vllm/" in __file__ else __file__)
    assert (out_calls, ring_calls) == (3, 1)
    assert out_s >= 3 * 0.004 and ring_s < out_s
    rows = waits.per_step(steps=3, top=1)
    assert len(rows) == 1 and "_output_wait" in rows[0][0]
    assert rows[0][1] == pytest.approx(1.0) and rows[0][2] == pytest.approx(out_s * 1e3 / 3)


def test_reentry_and_bad_step_counts_are_refused():
    waits = HostWaits(_Event)
    with waits:
        with pytest.raises(RuntimeError, match="already entered"):
            waits.__enter__()
    with pytest.raises(ValueError, match="steps=0"):
        waits.per_step(0)
