"""Deferred context-KV writes of the block drafters (VLLM_DEFER_DRAFT_CONTEXT_KV=1,
vllm/v1/worker/gpu/spec_decode/context_kv_ring.py): the ring's bookkeeping, and end to end on the
tiny DSpark engine (CPU, float32) that queued writes reach the draft cache before any draft pass
reads it: the same drafts, acceptance and tokens as writing in every step."""
from __future__ import annotations

import pytest
import torch

from vllm.v1.worker.gpu.spec_decode.context_kv_ring import (ENV_FLAG, DeferredContextKV,
                                                            deferral_enabled)

from tests.utils.context_kv_runs import run_switching_engine


def test_ring_appends_at_a_moving_offset_and_flushes_in_order():
    ring = DeferredContextKV(8, 3, 2, torch.float32, "cpu")
    a = torch.arange(9.0).view(3, 3)
    ring.append(a, torch.tensor([5, 6, 7]), [torch.tensor([10, 11, 12]), torch.tensor([20, 21])])
    ring.note_appended(3)
    b = -torch.ones(2, 3)
    ring.append(b, torch.tensor([8, 9]), [torch.tensor([13, -1]), torch.tensor([22, 23])])
    ring.note_appended(2)
    assert ring.fits(3) and not ring.fits(4)
    seen = []
    assert ring.flush(lambda aux, pos, slots: seen.append((aux.clone(), pos.clone(),
                                                           slots.clone())))
    aux, pos, slots = seen[0]
    assert torch.equal(aux, torch.cat([a, b]))
    assert pos.tolist() == [5, 6, 7, 8, 9]
    # A layer's mapping shorter than the step's tokens: the rest is PAD (-1), never written.
    assert slots.tolist() == [[10, 11, 12, 13, -1], [20, 21, -1, 22, 23]]
    assert ring.pending == 0 and not ring.flush(lambda *args: seen.append(args))
    # After a flush the next append starts at row 0 again.
    ring.append(b, torch.tensor([1, 2]), [torch.tensor([1, 2]), torch.tensor([3, 4])])
    ring.note_appended(2)
    ring.flush(lambda aux, pos, slots: seen.append(pos.clone()))
    assert seen[-1].tolist() == [1, 2]


def test_ring_refuses_an_overflow_and_bad_settings(monkeypatch):
    ring = DeferredContextKV(4, 2, 1, torch.float32, "cpu")
    ring.note_appended(3)
    with pytest.raises(RuntimeError, match="overflow: 3 \\+ 2 rows > capacity 4"):
        ring.note_appended(2)
    with pytest.raises(ValueError, match="capacity=0 is invalid"):
        DeferredContextKV(0, 2, 1, torch.float32, "cpu")
    monkeypatch.setenv(ENV_FLAG, "yes")
    with pytest.raises(ValueError, match=f"{ENV_FLAG}='yes' is invalid"):
        deferral_enabled()
    monkeypatch.setenv(ENV_FLAG, "1")
    assert deferral_enabled()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dspark", "dflash"])
@pytest.mark.parametrize("async_scheduling", [False, None], ids=["sync", "default-async"])
def test_deferred_context_kv_gives_the_same_drafts(monkeypatch, async_scheduling, method):
    common = dict(method=method, async_scheduling=async_scheduling)
    direct = run_switching_engine(monkeypatch, False, **common)
    deferred = run_switching_engine(monkeypatch, True, **common)
    # Rows were queued and written later (not a run in which nothing was deferred).
    assert deferred["flushed"] and max(deferred["flushed"]) > 1
    assert deferred["tokens"] == direct["tokens"]
    assert deferred["num_drafts"] == direct["num_drafts"] > 0
    assert deferred["drafts"] == direct["drafts"]  # every draft pass proposed the same
    assert deferred["accepted"] == direct["accepted"]
    # The check can fail: without the flushes the drafter reads context KV never written,
    # and its drafts change (the verified tokens do not).
    dropped = run_switching_engine(monkeypatch, True, drop_flush=True, **common)
    assert dropped["tokens"] == direct["tokens"]
    assert dropped["drafts"] != direct["drafts"]
