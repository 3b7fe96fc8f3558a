"""A step that raises because of one request's data fails that request, not the engine.

Real tiny model on CPU. The bad request carries top_k = 2**63 forced past SamplingParams
validation (standing in for any validation gap): the runner raises OverflowError while
registering it (issue 14, failure 1). Oracle for everyone else: the same prompts decoded greedily
alone on a fresh engine.
"""
import pytest

from tests.utils.engine_steps import greedy as greedy_params
from tests.utils.engine_steps import run_to_completion
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.engine.llm_engine import MAX_CONSECUTIVE_FAILED_STEPS, LLMEngine

PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3,"]
MAX_TOKENS = 8


def make_engine():
    from vllm.model_executor.models.tiny import write_tiny_models

    config = EngineArgs(model=str(write_tiny_models().target), max_model_len=128,
                        device="cpu").create_engine_config()
    return LLMEngine.from_vllm_config(config)


def greedy():
    return greedy_params(MAX_TOKENS)


@pytest.fixture(scope="module")
def engine():
    engine = make_engine()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(engine):
    finals = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"alone{i}", prompt, greedy())
        run_to_completion(engine, finals)
    return [finals[f"alone{i}"].outputs[0].text for i in range(len(PROMPTS))]


def test_bad_request_fails_alone_and_others_match_greedy(engine, reference):
    finals = {}
    engine.add_request("ok0", PROMPTS[0], greedy())
    engine.add_request("ok1", PROMPTS[1], greedy())
    for _ in range(2):  # both now live in the runner's persistent batch
        for out in engine.step():
            assert not out.finished
    bad = greedy()
    bad.top_k = 2**63  # what SamplingParams now refuses; the engine must survive it anyway
    engine.add_request("bad", PROMPTS[2], bad)
    engine.add_request("ok2", PROMPTS[2], greedy())  # admitted in the same step as "bad"
    run_to_completion(engine, finals)
    errors = engine.take_request_errors()
    assert set(errors) == {"bad"} and "OverflowError" in errors["bad"]
    assert finals["bad"].outputs[0].finish_reason == "error"
    assert [finals[f"ok{i}"].outputs[0].text for i in range(3)] == reference
    stats = engine.get_metrics()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    # and it keeps serving
    engine.add_request("after", PROMPTS[0], greedy())
    run_to_completion(engine, finals)
    assert finals["after"].outputs[0].text == reference[0]


def test_repeated_step_failures_are_fatal(engine, monkeypatch):
    calls = []

    def broken(scheduler_output):
        calls.append(1)
        raise RuntimeError("device lost")

    # Both entry points: the engine launches through execute_model_async under async scheduling
    # (the default here) and through execute_model otherwise.
    monkeypatch.setattr(engine.executor, "execute_model", broken)
    monkeypatch.setattr(engine.executor, "execute_model_async", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        for i in range(MAX_CONSECUTIVE_FAILED_STEPS + 1):
            engine.add_request(f"doomed{i}", PROMPTS[0], greedy())
            engine.step()
    assert len(calls) == MAX_CONSECUTIVE_FAILED_STEPS + 1
