"""GPU (H200): deferred context-KV writes (VLLM_DEFER_DRAFT_CONTEXT_KV=1) with CUDA graphs. The Q=1
graphs are captured with the ring append instead of the drafter's write; greedy tokens equal
writing in every step and the eager engine, and the drafts agree with writing in every step
(a batched flush may round differently from per-step writes in bf16, so agreement, not
identity; without the flushes agreement drops)."""
from __future__ import annotations

import pytest

from tests.utils.context_kv_runs import draft_agreement, run_switching_engine

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("method", ["dspark", "dflash"])
@pytest.mark.parametrize("backend,dtype", [("TORCH_MLA", "float32"),
                                           ("FLASHINFER_MLA", "bfloat16")])
def test_deferred_context_kv_with_graphs(monkeypatch, method, backend, dtype):
    common = dict(method=method, device="cuda", dtype=dtype, attention_backend=backend,
                  enforce_eager=False)
    direct = run_switching_engine(monkeypatch, False, **common)
    deferred = run_switching_engine(monkeypatch, True, **common)
    eager = run_switching_engine(monkeypatch, True, **{**common, "enforce_eager": True})
    assert deferred["flushed"] and max(deferred["flushed"]) > 1
    assert deferred["tokens"] == direct["tokens"] == eager["tokens"]
    agree = draft_agreement(deferred["drafts"], direct["drafts"])
    assert agree >= 0.9, agree
    assert draft_agreement(eager["drafts"], deferred["drafts"]) >= 0.9
    dropped = run_switching_engine(monkeypatch, True, drop_flush=True, **common)
    assert draft_agreement(dropped["drafts"], direct["drafts"], strict=False) < agree
