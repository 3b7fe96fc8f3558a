"""GPU: a block drafter's context KV written other than in every step, with CUDA graphs.

* "defer" (VLLM_DEFER_DRAFT_CONTEXT_KV=1, context_kv_ring.py): the Q=1 graphs are captured with
  the ring append instead of the drafter's write, flushed before draft passes;
* "refill" (VLLM_DRAFT_CONTEXT_REFILL=1, context_refill.py): Q=1 steps after which nobody
  drafts replay graphs captured without the write, and the stale positions are refilled by a
  target forward before the next draft pass.

Either way greedy tokens equal writing in every step and the eager engine, and the drafts agree
with writing in every step (a batched flush or a prefill-shaped refill may round differently
from per-step writes in bf16, so agreement, not identity); without the flushes / refills
agreement drops."""
from __future__ import annotations

import pytest

from tests.utils.context_kv_runs import (GRAPH_CASES, check_graphs_against_writing,
                                         graph_settings)

pytestmark = pytest.mark.gpu

# way -> (run_switching_engine's keywords for it, the keywords that leave its writes out)
WAYS = {"defer": (dict(defer=True), dict(drop_flush=True)),
        "refill": (dict(refill=True), dict(drop_refill=True))}


@pytest.mark.parametrize("method,backend,dtype", GRAPH_CASES)
@pytest.mark.parametrize("way", list(WAYS))
def test_context_kv_written_out_of_step_with_graphs(monkeypatch, way, method, backend, dtype):
    variant, dropped = WAYS[way]
    run, eager = check_graphs_against_writing(
        monkeypatch, graph_settings(method, backend, dtype), dict(variant), dropped)
    if way == "defer":
        assert run["flushed"] and max(run["flushed"]) > 1  # rows were queued, then written
    else:
        # the plain steps replayed the graphs captured without the write, and were refilled
        assert run["context_free_replays"] > 0
        assert run["refills"][0] >= 1 and eager["refills"][0] >= 1
