"""GPU: the worker's memory plan on the built-in tiny model (issue #11's "peak within the plan").

Run on the GPU node: `pytest -m gpu tests/v1/worker/test_memory_profile_gpu.py -v`.
- the profiled activation peak of the worst-case step is > 0 and the profile's shape is the
  budget after cached context;
- nothing of the profile stays allocated but the caches a first step makes for good (cuBLAS
  workspaces: clearing them frees at least that much): after start-up the process holds
  exactly what the plan names (weights + runner buffers + those caches + KV + what
  initialize_kv_cache took), within 8 MiB;
- real prefills (one budget-sized step, and a chunked prompt whose later chunks read cached
  context) peak within 10 % of weights + runner buffers + KV + profiled activation + graphs,
  and their transient stays within the profiled activation peak (+10 %);
- a gpu_memory_utilization too small for the plan fails with the plan's numbers.
"""
from __future__ import annotations

import gc

import pytest
import torch

from vllm.model_executor.models.tiny import write_tiny_models

pytestmark = pytest.mark.gpu

BUDGET = 1024
MAX_LEN = 4096
TOLERANCE = 8 << 20  # bytes: allocator rounding, the sampler's small per-step tensors


def _engine(enforce_eager: bool, utilization: float = 0.1, backend: str = "FLASHINFER_MLA"):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    args = EngineArgs(model=write_tiny_models().target, max_model_len=MAX_LEN, max_num_seqs=4,
                      max_num_batched_tokens=BUDGET, enable_chunked_prefill=True, block_size=16,
                      gpu_memory_utilization=utilization, enforce_eager=enforce_eager, seed=0,
                      attention_backend=backend, device="cuda", dtype="bfloat16")
    return LLMEngine.from_engine_args(args)


def _baseline() -> int:
    # cuBLAS keeps a workspace per stream in torch's allocator once a matmul ran; an earlier
    # test's would otherwise be in the baseline, and this test's result would hang on the order.
    torch._C._cuda_clearCublasWorkspaces()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def _prefill(engine, rid: str, n: int) -> None:
    from vllm.sampling_params import SamplingParams
    engine.add_request(rid, [(7 * i + 3) % 250 for i in range(n)],
                       SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_profile_leaves_nothing_and_prefill_stays_in_the_plan(enforce_eager):
    base = _baseline()
    engine = _engine(enforce_eager)
    try:
        worker = engine.executor.worker
        plan = worker.memory_profile
        assert plan is not None and plan.activation_peak_bytes > 0
        assert (plan.profile_tokens, plan.profile_context_tokens) == (BUDGET, MAX_LEN - BUDGET)
        assert plan.kv_cache_bytes > 0 and plan.num_blocks > 0
        assert (plan.graph_capture_seconds is None) == enforce_eager
        # After the profile (before the KV cache) only weights + runner buffers + the caches
        # the first step made (checked below to be cuBLAS workspaces) were held.
        assert abs(plan.torch_in_use_bytes - base - plan.weights_bytes
                   - plan.runner_buffer_bytes - plan.first_step_cache_bytes) <= TOLERANCE
        # After start-up: exactly the plan's static parts.
        torch.cuda.synchronize()
        static = torch.cuda.memory_allocated() - base
        assert abs(static - plan.static_bytes) <= TOLERANCE, (static, plan.static_bytes)
        # The KV budget is what the profile left of gpu_memory_utilization (blocks round down).
        per_block = plan.kv_cache_bytes // plan.num_blocks
        assert plan.kv_budget_bytes - per_block < plan.kv_cache_bytes <= plan.kv_budget_bytes

        planned = plan.planned_bytes  # weights + buffers + KV + activation + graphs
        for rid, n in (("one_step", BUDGET), ("chunked", MAX_LEN - 8)):
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            _prefill(engine, rid, n)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            transient = torch.cuda.max_memory_allocated() - before
            assert peak <= 1.10 * planned, (rid, peak, planned)
            assert transient <= 1.10 * plan.activation_peak_bytes + TOLERANCE, \
                (rid, transient, plan.activation_peak_bytes)
        # What the profile kept is library workspaces, not a leaked activation: dropping cuBLAS's
        # workspaces frees at least that much (more when graph capture used other streams).
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch._C._cuda_clearCublasWorkspaces()
        freed = held - torch.cuda.memory_allocated()
        assert freed >= plan.first_step_cache_bytes - TOLERANCE, (freed, plan.first_step_cache_bytes)
    finally:
        engine.shutdown()


def test_too_small_utilization_names_the_plan():
    _baseline()
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache.*activation peak"):
        engine = _engine(True, utilization=1e-6)
        engine.shutdown()
    gc.collect()
    torch.cuda.empty_cache()
