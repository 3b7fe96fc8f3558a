"""AsyncLLM on a fake engine: batching, streaming, aborts freeing KV blocks, engine death."""
import asyncio
import time
from types import SimpleNamespace

import pytest

from tests.utils.fake_engine import NUM_BLOCKS, FakeEngine, expected_text
from vllm.v1.engine.async_llm import AsyncLLM, EngineDeadError


def params(max_tokens):
    return SimpleNamespace(max_tokens=max_tokens)


@pytest.fixture
def fake_llm():
    engine = FakeEngine(max_model_len=64)
    llm = AsyncLLM(engine, model_name="fake", max_model_len=64)
    yield engine, llm
    llm.shutdown()


def wait_until(predicate, timeout=5.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_concurrent_requests_are_batched_and_complete(fake_llm):
    engine, llm = fake_llm

    async def one(i):
        prompt = [i % 26, (i * 7) % 26]
        last = None
        async for out in llm.generate(prompt, params(5), request_id=f"r{i}"):
            last = out
        return prompt, last

    async def main():
        return await asyncio.gather(*(one(i) for i in range(50)))

    results = asyncio.run(main())
    for prompt, last in results:
        assert last.finished
        assert last.outputs[0].text == expected_text(prompt, 5)
    assert engine.max_batch_seen > 1  # requests shared engine steps
    assert wait_until(lambda: llm.get_metrics()["num_free_blocks"] == NUM_BLOCKS)


def test_abandoned_stream_aborts_and_frees_blocks(fake_llm):
    engine, llm = fake_llm

    async def main():
        stream = await llm.add_request("keep-going", [1, 2, 3], params(10_000))
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 3:
                break  # consumer walks away mid-stream
        # an unrelated request still gets served afterwards
        last = None
        async for out in llm.generate([4], params(3), request_id="after"):
            last = out
        return last

    last = asyncio.run(main())
    assert last.finished and last.outputs[0].text == expected_text([4], 3)
    assert wait_until(lambda: "keep-going" in engine.aborted)
    assert wait_until(lambda: llm.get_metrics()["num_free_blocks"] == NUM_BLOCKS)
    assert llm.is_healthy


def test_engine_rejection_raises_value_error_and_engine_keeps_serving(fake_llm):
    _, llm = fake_llm

    async def main():
        with pytest.raises(ValueError, match="max_model_len is 64"):
            await llm.add_request("too-long", list(range(64)), params(1))
        outs = [o async for o in llm.generate([1], params(2), request_id="ok")]
        return outs[-1]

    assert asyncio.run(main()).finished


def test_duplicate_request_id_is_refused(fake_llm):
    _, llm = fake_llm

    async def main():
        stream = await llm.add_request("dup", [1], params(10_000))
        with pytest.raises(ValueError, match="already running"):
            await llm.add_request("dup", [2], params(1))
        await llm.abort("dup")
        # the aborted stream ends (no hang, no error) and never reports a finished output
        outs = await asyncio.wait_for(_drain(stream), timeout=5)
        assert not any(o.finished for o in outs)

    asyncio.run(main())
    assert "dup" in fake_llm[0].aborted


async def _drain(stream):
    return [o async for o in stream]


def test_engine_crash_reaches_waiters_and_later_requests():
    engine = FakeEngine(fail_after_steps=2)
    llm = AsyncLLM(engine, model_name="fake", max_model_len=64)
    try:
        async def main():
            with pytest.raises(EngineDeadError, match="simulated device failure"):
                async for _ in llm.generate([1], params(100), request_id="victim"):
                    pass
            with pytest.raises(EngineDeadError):
                await llm.add_request("late", [1], params(1))

        asyncio.run(main())
        assert not llm.is_healthy
        assert isinstance(llm.dead_error, RuntimeError)
    finally:
        llm.shutdown()


def test_failure_outside_step_also_fails_waiters_instead_of_hanging():
    class BrokenAbort(FakeEngine):
        def abort_request(self, ids):
            raise RuntimeError("abort exploded")

    llm = AsyncLLM(BrokenAbort(), model_name="fake", max_model_len=64)
    try:
        async def main():
            # Effectively endless requests: on a loaded machine the engine thread can run many
            # thousands of fake steps before this coroutine gets to abort.
            waiter = await llm.add_request("waiter", [1], params(10**9))
            await llm.abort("other")  # unknown id: never reaches the engine
            doomed = await llm.add_request("doomed", [2], params(10**9))
            await llm.abort("doomed")
            with pytest.raises(EngineDeadError, match="abort exploded"):
                await asyncio.wait_for(_drain(waiter), timeout=5)
            del doomed

        asyncio.run(main())
        assert not llm.is_healthy
    finally:
        llm.shutdown()
