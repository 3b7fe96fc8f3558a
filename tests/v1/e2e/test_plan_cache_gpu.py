"""GPU: FlashInfer MLA graph plans kept by chunk structure (flashinfer_plan_cache.py) and put
back when a later request reaches the same structure. One request at a time (max_num_seqs=1,
the B=1 case the cache is for), three requests of one prompt length, so the second and third
cross the chunk edges the first planned; tiny model, bf16, CUDA graphs, DCP 1. Greedy tokens
equal the same engine with the cache off (FlashInfer planning every new structure) and the
eager engine, and plans were put back. The CPU tests (test_flashinfer_mla_plan_cache.py) check
the plans themselves against a model of FlashInfer's planner."""
from __future__ import annotations

import pytest

from tests.utils.engine_steps import greedy, run_with_arrivals
from vllm.benchmarks.datasets import spec_bench_prompt
from vllm.benchmarks.spec_step_kinds import plan_cache_put_backs
from vllm.v1.attention.backends.mla.flashinfer_plan_cache import PLAN_CACHE_FLAG

pytestmark = pytest.mark.gpu


def _run(spec, mode: str, monkeypatch) -> tuple[dict, list[int]]:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    monkeypatch.setenv(PLAN_CACHE_FLAG, "0" if mode == "off" else "1")
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=None, dtype="bfloat16", max_model_len=512, attention_backend="FLASHINFER_MLA",
        speculative_config=spec, max_num_seqs=1, enforce_eager=mode == "eager", seed=0))
    try:
        # 64 prompt tokens + 160 new ones: at B=1 the chunk limit is 32, so each request
        # passes chunk counts 2 to 7
        requests = {f"r{i}": (spec_bench_prompt(i, 64), greedy(160)) for i in range(3)}
        tokens = {r: out[0] for r, out in run_with_arrivals(engine, requests).items()}
        return tokens, plan_cache_put_backs(engine.executor.worker.model_runner)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("method", [None, "dspark"], ids=["plain", "dspark"])
def test_kept_plans_keep_greedy_tokens(method, monkeypatch):
    spec = None if method is None else {"method": method, "num_speculative_tokens": 4}
    kept, put_backs = _run(spec, "on", monkeypatch)
    planned, none = _run(spec, "off", monkeypatch)
    eager, _ = _run(spec, "eager", monkeypatch)
    assert sum(none) == 0
    # the verify (or decode) group: requests 2 and 3 cross 5 chunk edges each
    assert put_backs[0] >= 5, put_backs
    assert kept == planned
    assert kept == eager
