"""GPU: the drafter's context KV refilled before draft passes (VLLM_DRAFT_CONTEXT_REFILL=1,
context_refill.py) with CUDA graphs. Plain Q=1 steps after which nobody drafts replay graphs
captured without the context write; greedy tokens equal writing in every step and the eager
engine, and the drafts agree with writing in every step (the refill's prefill-shaped forward
may round differently from the decode steps in bf16, so agreement, not identity; without the
refill agreement drops)."""
from __future__ import annotations

import pytest

from tests.utils.context_kv_runs import draft_agreement, run_switching_engine

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("method", ["dspark", "dflash"])
@pytest.mark.parametrize("backend,dtype", [("TORCH_MLA", "float32"),
                                           ("FLASHINFER_MLA", "bfloat16")])
def test_refilled_context_kv_with_graphs(monkeypatch, method, backend, dtype):
    common = dict(method=method, device="cuda", dtype=dtype, attention_backend=backend,
                  enforce_eager=False)
    direct = run_switching_engine(monkeypatch, False, **common)
    refilled = run_switching_engine(monkeypatch, False, refill=True, **common)
    eager = run_switching_engine(monkeypatch, False, refill=True,
                                 **{**common, "enforce_eager": True})
    assert refilled["context_free_replays"] > 0 and direct["context_free_replays"] == 0
    assert refilled["refills"][0] >= 1 and eager["refills"][0] >= 1
    assert refilled["tokens"] == direct["tokens"] == eager["tokens"]
    agree = draft_agreement(refilled["drafts"], direct["drafts"])
    assert agree >= 0.9, agree
    assert draft_agreement(eager["drafts"], refilled["drafts"]) >= 0.9
    dropped = run_switching_engine(monkeypatch, False, refill=True, drop_refill=True, **common)
    assert dropped["tokens"] == direct["tokens"]
    assert draft_agreement(dropped["drafts"], direct["drafts"], strict=False) < agree
