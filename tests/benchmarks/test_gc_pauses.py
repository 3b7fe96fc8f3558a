"""GcPauses (vllm/benchmarks/gc_pauses.py) counts the collections run while it is entered, per
generation, and nothing outside; benchmark_spec_policy reports them per timed step."""
from __future__ import annotations

import gc

import pytest

from vllm.benchmarks.gc_pauses import GcPauses


def test_it_counts_the_collections_inside_per_generation():
    pauses = GcPauses()
    gc.collect(2)  # outside: not counted
    with pauses:
        gc.collect(0)
        gc.collect(0)
        gc.collect(2)
    gc.collect(1)  # outside again
    counts = {g: n for g, (n, _) in pauses.by_generation.items()}
    assert counts == {0: 2, 2: 1}
    assert pauses.seconds > 0
    summary = pauses.summary()
    assert list(summary) == ["0", "2"] and summary["0"][0] == 2
    assert gc.callbacks.count(pauses._callback) == 0  # removed on exit


def test_it_refuses_to_be_entered_twice():
    pauses = GcPauses()
    with pauses:
        with pytest.raises(RuntimeError, match="already entered"):
            pauses.__enter__()
