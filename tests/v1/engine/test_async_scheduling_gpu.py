"""GPU (H200): async scheduling with CUDA graphs gives the synchronous engine's tokens (greedy and
seeded sampling, both MLA backends), and a steady overlapped decode step makes no host sync of
its own: under torch.cuda.set_sync_debug_mode("error") only the collection's event wait (the
step's one transfer) runs outside the check."""
from __future__ import annotations

import pytest
import torch

from tests.utils.sync_debug import exempt_from_sync_debug
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.models.tiny import write_tiny_models
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.gpu

PROMPTS = [[(7 * i + 5 * j) % 240 + 10 for j in range(5 + 3 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def tiny():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return write_tiny_models()


def _engine(tiny, backend: str, async_scheduling: bool) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(
        model=tiny.target, attention_backend=backend, seed=0, max_num_seqs=8,
        max_num_batched_tokens=64, async_scheduling=async_scheduling))


def _generate(engine, params_of) -> dict:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params_of(i))
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = list(out.outputs[0].token_ids)
    return finals


@pytest.mark.parametrize("backend", ["TORCH_MLA", "FLASHINFER_MLA"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_async_equals_sync_with_graphs(tiny, backend, sampling):
    def params_of(i):
        if sampling == "greedy":
            return SamplingParams(temperature=0.0, max_tokens=20 + i, ignore_eos=True)
        return SamplingParams(temperature=0.8, seed=11 + i, max_tokens=20 + i, ignore_eos=True)
    results = []
    for mode in (False, True):
        engine = _engine(tiny, backend, mode)
        try:
            assert engine.executor.worker.model_runner.cudagraphs is not None
            results.append(_generate(engine, params_of))
        finally:
            engine.shutdown()
    assert results[1] == results[0]
    assert all(len(results[0][f"r{i}"]) == 20 + i for i in range(len(PROMPTS)))


def test_overlapped_decode_step_makes_no_host_sync(tiny):
    engine = _engine(tiny, "FLASHINFER_MLA", True)
    try:
        runner = engine.executor.worker.model_runner
        buffers = runner._step_buffers
        waits = []
        # the step's one transfer completes here
        buffers.wait = exempt_from_sync_debug(buffers.wait, waits)
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS[:4]):
            engine.add_request(f"r{i}", prompt, params)
        for _ in range(6):  # prefill and the first decode steps, unchecked
            engine.step()
        before = len(waits)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(10):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert len(waits) - before == 10
    finally:
        engine.shutdown()


def _spec_engine(tiny, method: str, disable_by_batch_size, async_scheduling: bool) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(
        model=tiny.target, attention_backend="FLASHINFER_MLA", seed=0, max_num_seqs=8,
        max_num_batched_tokens=64, async_scheduling=async_scheduling,
        speculative_config={"method": method, "model": getattr(tiny, method),
                            "num_speculative_tokens": 3,
                            "disable_by_batch_size": disable_by_batch_size}))


@pytest.mark.parametrize("method", ["eagle", "dspark"])
@pytest.mark.parametrize("disable_by_batch_size", [None, 1, 4])
def test_speculative_async_equals_sync_with_graphs(tiny, method, disable_by_batch_size):
    # Speculative engines overlap only their steps without drafts (block drafters whose next
    # step lets nobody draft); with graphs the tokens equal the synchronous engine's. N=4: the
    # six requests draft only once fewer than four remain (steps of both kinds in one run).
    def params_of(i):
        return SamplingParams(temperature=0.0, max_tokens=20 + 4 * i, ignore_eos=True)
    results = []
    for mode in (False, True):
        engine = _spec_engine(tiny, method, disable_by_batch_size, mode)
        try:
            assert engine.async_scheduling == mode
            results.append(_generate(engine, params_of))
        finally:
            engine.shutdown()
    assert results[1] == results[0]
