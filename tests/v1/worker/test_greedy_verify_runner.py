"""The runner's eager greedy verification (`_verify_greedy`, one launch instead of the rejection
sampler's glue) in whole runs: for every drafter, greedy speculative decoding on CPU (eager: no
CUDA graphs) equals plain greedy decoding (full-recomputation oracle) with the rejection sampler
made unreachable, so every verified step went through the fast path; with scripted rejections
(forced drafts: every acceptance length, including 0 and all k) and requests arriving mid-run
(prefill rows that do not sample share verify batches)."""
from __future__ import annotations

import pytest

from tests.utils.runner_harness import Scenario, greedy_oracle, make_config, make_runner, run_scenario
from vllm.model_executor.models.tiny import write_tiny_models

PROMPTS = {"a": [72, 101, 108, 108, 111, 32, 119, 111],
           "b": [84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111],
           "c": [1, 2, 3]}


@pytest.fixture(scope="module")
def tiny():
    paths = write_tiny_models()
    oracle = greedy_oracle(make_runner(make_config(paths.target)).model, PROMPTS, 10)
    return paths, oracle


@pytest.mark.parametrize("method,k", [("eagle", 3), ("mtp", 3), ("dflash", 3), ("dspark", 4)])
@pytest.mark.parametrize("forced", [False, True])
def test_eager_greedy_verification_equals_plain_greedy(tiny, monkeypatch, method, k, forced):
    paths, oracle = tiny
    runner = make_runner(make_config(paths.target, method, getattr(paths, method), k=k))
    calls = {"fast": 0}
    original = runner._verify_greedy

    def counted(*args):
        calls["fast"] += 1
        return original(*args)

    def unreachable(*args, **kwargs):
        raise AssertionError("a greedy raw-logits step reached the rejection sampler")

    monkeypatch.setattr(runner, "_verify_greedy", counted)
    monkeypatch.setattr(runner.rejection_sampler, "verify", unreachable)
    scenario = Scenario("greedy", PROMPTS, max_new_tokens=10, arrival_step={"c": 2},
                        forced_accepts={"a": [1, -1, 0], "b": [2, 0, -1], "c": [-1, 1]}
                        if forced else None)
    result = run_scenario(runner, scenario, oracle)
    assert result.outputs == oracle
    assert calls["fast"] > 3
    if forced:  # the scripted acceptances were verified exactly
        assert result.accepted["a"][:3] == [1, k, 0] and result.accepted["b"][:3] == [2, 0, k]
