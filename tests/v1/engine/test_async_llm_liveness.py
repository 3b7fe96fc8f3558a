"""AsyncLLM liveness: the step watchdog, death callbacks, per-request failures (fake engine)."""
import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from tests.utils.fake_engine import FakeEngine
from vllm.v1.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError


class HangingEngine(FakeEngine):
    """step() blocks (a hung worker) once `hang` is set."""

    def __init__(self):
        super().__init__(max_model_len=64)
        self.hang = threading.Event()
        self.release = threading.Event()

    def step(self):
        if self.hang.is_set():
            self.release.wait(30)
        return super().step()


class FailingOneEngine(FakeEngine):
    """Reports request "bad" as failed by the step (what LLMEngine's isolation produces)."""

    def __init__(self):
        super().__init__(max_model_len=64)
        self.errors = {}

    def step(self):
        if "bad" in self.requests:
            self.abort_request(["bad"])
            self.errors["bad"] = "the request failed inside an engine step: OverflowError: x"
        return super().step()

    def take_request_errors(self):
        errors, self.errors = self.errors, {}
        return errors


def test_watchdog_turns_a_hung_step_into_engine_death(monkeypatch):
    monkeypatch.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "0.5")
    engine = HangingEngine()
    llm = AsyncLLM(engine, model_name="fake", max_model_len=64)
    deaths = []
    llm.add_dead_callback(deaths.append)
    engine.hang.set()

    async def main():
        with pytest.raises(EngineDeadError, match="VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"):
            async for _ in llm.generate([1, 2], SimpleNamespace(max_tokens=5)):
                pass

    try:
        start = time.time()
        asyncio.run(main())
        assert time.time() - start < 5
        assert len(deaths) == 1 and isinstance(deaths[0], TimeoutError)
        assert not llm.is_healthy and "engine is dead" in llm.health_problem()
    finally:
        engine.release.set()
        llm.shutdown()


def test_health_reports_a_stalled_step_before_the_watchdog(monkeypatch):
    monkeypatch.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "60")
    monkeypatch.setattr("vllm.v1.engine.async_llm.HEALTH_STALL_S", 0.3)
    engine = HangingEngine()
    llm = AsyncLLM(engine, model_name="fake", max_model_len=64)
    engine.hang.set()

    async def main():
        stream = await llm.add_request("r", [1], SimpleNamespace(max_tokens=2))
        await asyncio.sleep(0.8)
        problem = llm.health_problem()
        engine.release.set()
        async for _ in stream:
            pass
        return problem

    try:
        assert "engine step running for" in asyncio.run(main())
        assert llm.is_healthy  # it recovered: the step returned
    finally:
        engine.release.set()
        llm.shutdown()


def test_request_failed_by_the_step_fails_alone():
    engine = FailingOneEngine()
    llm = AsyncLLM(engine, model_name="fake", max_model_len=64)

    async def run(request_id):
        last = None
        async for out in llm.generate([3], SimpleNamespace(max_tokens=4), request_id=request_id):
            last = out
        return last

    async def main():
        return await asyncio.gather(run("bad"), run("good"), return_exceptions=True)

    try:
        bad, good = asyncio.run(main())
        assert isinstance(bad, RequestFailedError) and "OverflowError" in str(bad)
        assert good.finished and llm.is_healthy
    finally:
        llm.shutdown()


def test_a_request_cancelled_before_admission_does_not_kill_the_engine(monkeypatch):
    # A client that gives up while its add command still waits in the queue cancels the
    # admission future; completing a cancelled future raised InvalidStateError in the engine
    # loop and killed the engine for everybody (seen under the disconnect load test).
    monkeypatch.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "60")
    engine = HangingEngine()
    llm = AsyncLLM(engine, model_name="fake", max_model_len=64)
    engine.hang.set()

    async def main():
        first = await llm.add_request("r", [1], SimpleNamespace(max_tokens=3))
        await asyncio.sleep(0.2)  # the loop is inside the hung step now
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(llm.add_request("late", [2], SimpleNamespace(max_tokens=2)),
                                   0.2)
        engine.hang.clear()
        engine.release.set()
        async for _ in first:
            pass
        return [o async for o in llm.generate([3], SimpleNamespace(max_tokens=2))]

    try:
        outputs = asyncio.run(main())
        assert outputs and outputs[-1].finished
        assert llm.is_healthy
        assert "late" not in engine.requests
    finally:
        engine.release.set()
        llm.shutdown()
