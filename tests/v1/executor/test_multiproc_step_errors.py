"""Multi-process workers (-tp 2 -dcp 2, gloo, CPU): a step that raises on every rank because of
one request's data fails that request alone; the engine and its workers keep serving.

The bad request carries top_k = 2**63 forced past SamplingParams validation: every rank's runner
raises OverflowError while registering it, before any collective. Oracle for the others: the
same prompts decoded greedily alone on the same engine before the failure.
"""
import pytest

from tests.utils.engine_steps import greedy as greedy_params
from tests.utils.engine_steps import run_to_completion
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.executor.abstract import StepError, WorkerError

PROMPTS = ["Hello, my name is", "The capital of France is"]
MAX_TOKENS = 6


def greedy():
    return greedy_params(MAX_TOKENS)


@pytest.fixture(scope="module")
def engine():
    from vllm.model_executor.models.tiny import write_tiny_models

    config = EngineArgs(model=str(write_tiny_models().target), max_model_len=128, device="cpu",
                        tensor_parallel_size=2,
                        decode_context_parallel_size=2).create_engine_config()
    engine = LLMEngine.from_vllm_config(config)
    yield engine
    engine.shutdown()


def test_step_error_on_every_rank_fails_the_request_alone(engine):
    finals = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"alone{i}", prompt, greedy())
    run_to_completion(engine, finals)
    reference = [finals[f"alone{i}"].outputs[0].text for i in range(len(PROMPTS))]

    engine.add_request("ok0", PROMPTS[0], greedy())
    bad = greedy()
    bad.top_k = 2**63  # what SamplingParams refuses; the workers must survive it anyway
    engine.add_request("bad", PROMPTS[1], bad)
    engine.add_request("ok1", PROMPTS[1], greedy())
    run_to_completion(engine, finals)
    errors = engine.take_request_errors()
    assert set(errors) == {"bad"} and "OverflowError" in errors["bad"]
    assert finals["bad"].outputs[0].finish_reason == "error"
    assert [finals["ok0"].outputs[0].text, finals["ok1"].outputs[0].text] == reference
    assert not engine.executor.is_shutdown
    stats = engine.get_metrics()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_step_error_on_some_ranks_only_is_fatal(monkeypatch):
    """Ranks that disagree (one raised, one completed the step) cannot be reconciled: the
    executor fails and shuts down, as for any other worker failure."""
    from vllm.v1.executor import multiproc_executor as mpe

    executor = object.__new__(mpe.MultiprocExecutor)
    executor.world_size, executor.is_shutdown = 2, False

    class Conn:
        def __init__(self, message):
            self.message = message

        def poll(self):
            return True

        def recv(self):
            return self.message

    class Proc:
        sentinel = None
        exitcode = None

        def join(self, timeout=None):
            pass

        def is_alive(self):
            return False

    executor.conns = [Conn(("step_error", "Traceback\nOverflowError: x")), Conn(("ok", None))]
    executor.processes = [Proc(), Proc()]
    monkeypatch.setattr(mpe, "wait_for_any", lambda objs, timeout=None: list(objs[:2]))
    monkeypatch.setattr(executor, "shutdown", lambda graceful=True: None)
    with pytest.raises(WorkerError, match="ranks \\[1\\] completed it"):
        executor._gather("execute_model", 5.0)
    executor.conns = [Conn(("step_error", "Traceback\nOverflowError: x")),
                      Conn(("step_error", "Traceback\nOverflowError: x"))]
    with pytest.raises(StepError) as info:
        executor._gather("execute_model", 5.0)
    assert info.value.summary() == "OverflowError: x"
