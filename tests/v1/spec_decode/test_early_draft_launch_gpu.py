"""GPU: the early draft step lowered on the device and launched before the wait.

With VLLM_EARLY_DRAFT_METADATA=1 and VLLM_EARLY_DRAFT_DEVICE_LOWERING=1 a block drafter's
draft step is planned from the all-accepted upper bound while the verify step runs, lowered to
the exact lengths on the device and replayed right away, before the runner waits for the step's
output (BlockSpeculator.prepare_early; early_draft.py). The CPU test
(tests/v1/spec_decode/test_early_draft.py) can only stand in for FlashInfer's lowering; here it
is FlashInfer MLA with CUDA graphs on the tiny model (bfloat16, DCP 1):
- greedy tokens equal those of the same drafter with the early path off (late drafts, exact
  host plans), and the launch happened in most verify steps (some of them on the previous
  step's plans, advanced on the device);
- a steady step with the launch runs under torch.cuda.set_sync_debug_mode("error") with only
  the runner's one device->host transfer exempted (the launch adds no host sync).
Run on the GPU node: `bash scripts/gpu_validation.sh earlylaunch`.
"""
from __future__ import annotations

import pytest

from tests.utils.runner_harness import Scenario, make_config, make_runner, run_scenario
from tests.utils.sync_debug import (exempt_from_sync_debug, is_decode_only,
                                     run_under_sync_debug)
from vllm.model_executor.models.tiny import write_tiny_models
from vllm.v1.worker.gpu.spec_decode.early_draft import (DEVICE_LOWERING_FLAG, ENV_FLAG,
                                                        FUSED_LOWERING_FLAG)

pytestmark = pytest.mark.gpu

METHODS = [("dflash", 3), ("dspark", 4)]
PROMPTS = {"a": [(7 * i + 3) % 256 for i in range(23)], "b": [(5 * i + 11) % 256 for i in range(9)],
           "c": [(3 * i + 1) % 256 for i in range(40)]}


@pytest.fixture(scope="module")
def paths():
    return write_tiny_models()


def _graph_runner(paths, method: str, k: int):
    config = make_config(paths.target, method, getattr(paths, method), k=k,
                         backend="FLASHINFER_MLA", device="cuda", dtype="bfloat16",
                         max_model_len=256)
    config.model_config.enforce_eager = False
    runner = make_runner(config, device="cuda")
    assert runner.cudagraphs is not None and runner.speculator.cudagraphs is not None
    return runner


@pytest.mark.parametrize("method,k", METHODS)
def test_draft_step_launched_before_the_wait_keeps_greedy_tokens(paths, method, k, monkeypatch):
    scenario = Scenario("launch", PROMPTS, max_new_tokens=24, arrival_step={"c": 2})
    monkeypatch.setenv(ENV_FLAG, "1")
    monkeypatch.setenv(DEVICE_LOWERING_FLAG, "1")
    launched = _graph_runner(paths, method, k)
    with_launch = run_scenario(launched, scenario, record_draft_logits=False)
    spec = launched.speculator
    # Steady verify steps of 3 requests: nearly every one is eligible and fits its skeleton.
    assert spec.early_launches >= 5, (spec.early_launches, spec.early_refreshes,
                                      spec.early_rebuilds, spec.early_reuses)
    # (early_reuses: launched steps that advanced the previous step's plans instead of
    # building; where they happen depends on page crossings, so no count is asserted here:
    # tests/v1/attention/test_flashinfer_mla_gpu.py checks the advance against TORCH_MLA)
    assert spec.early_reuses <= spec.early_launches
    assert spec.early_device_lowerings >= spec.early_launches
    monkeypatch.setenv(ENV_FLAG, "0")
    late = _graph_runner(paths, method, k)
    without = run_scenario(late, scenario, record_draft_logits=False)
    assert late.speculator.early_launches == 0
    assert with_launch.outputs == without.outputs


@pytest.mark.parametrize("method,k", METHODS)
def test_the_input_write_that_lowers_the_plans_drafts_what_a_lowering_launch_drafts(
        paths, method, k, monkeypatch):
    """VLLM_FUSED_DRAFT_PLAN_LOWERING=1: where an early step advances the previous
    step's plans, the block input write lowers them (plan_lowering.FusedDraftLowering); =0:
    the advance's own lowering launch after the write. Same plans, same lengths: every
    proposal (the drafts themselves, not only the greedy tokens) and every accepted count
    must be identical, and the fused write must have done the lowering in some steps."""
    scenario = Scenario("fused", PROMPTS, max_new_tokens=40, arrival_step={"c": 2})
    monkeypatch.setenv(ENV_FLAG, "1")
    monkeypatch.setenv(DEVICE_LOWERING_FLAG, "1")
    runs = {}
    for fused in ("1", "0"):
        monkeypatch.setenv(FUSED_LOWERING_FLAG, fused)
        runner = _graph_runner(paths, method, k)
        runs[fused] = (run_scenario(runner, scenario, record_draft_logits=False),
                       runner.speculator)
    (fused, spec), (own, spec_own) = runs["1"], runs["0"]
    assert spec.fuses_plan_lowering() and not spec_own.fuses_plan_lowering()
    assert spec.early_fused_lowerings >= 3, (spec.early_fused_lowerings, spec.early_reuses)
    assert spec_own.early_fused_lowerings == 0
    assert spec.early_reuses == spec_own.early_reuses
    assert fused.proposals == own.proposals
    assert fused.accepted == own.accepted and fused.outputs == own.outputs


@pytest.mark.parametrize("method,k", METHODS)
def test_a_step_with_the_launch_has_one_device_to_host_transfer(paths, method, k, monkeypatch):
    monkeypatch.setenv(ENV_FLAG, "1")
    monkeypatch.setenv(DEVICE_LOWERING_FLAG, "1")
    runner = _graph_runner(paths, method, k)
    transfers = []
    runner._copy_step_output = exempt_from_sync_debug(runner._copy_step_output, transfers)
    checked = {"steps": 0, "launched": 0}
    real_execute = runner.execute_model

    def execute(scheduler_output):
        if not is_decode_only(scheduler_output) or runner.speculator.early_launches < 2:
            return real_execute(scheduler_output)
        launches = runner.speculator.early_launches
        out = run_under_sync_debug(real_execute, scheduler_output, transfers)
        checked["steps"] += 1
        checked["launched"] += runner.speculator.early_launches - launches
        return out

    runner.execute_model = execute
    scenario = Scenario("sync", {"a": PROMPTS["a"], "b": PROMPTS["b"]}, max_new_tokens=24)
    run_scenario(runner, scenario, record_draft_logits=False)
    assert checked["launched"] >= 2, checked


@pytest.mark.parametrize("method,k", METHODS)
def test_the_early_block_write_is_compiled_with_the_graphs(paths, method, k, monkeypatch):
    """The early step's block input write reads the runner's device state as it lies (the
    kernel's indirect variant, block_inputs.py); the runner compiles that variant next to
    the graph captures (GPUModelRunner._warm_early_block_write), so no serving step waits
    for Triton to JIT-compile it: no cache miss of the kernel while early steps run. Likewise
    the plan lowering (plan_lowering.warm_plan_lowering, both kv_len_arr alignments; twenty-fifth
    session, not yet run on a GPU)."""
    knobs = pytest.importorskip("triton").knobs
    monkeypatch.setenv(ENV_FLAG, "1")
    monkeypatch.setenv(DEVICE_LOWERING_FLAG, "1")
    monkeypatch.setenv(FUSED_LOWERING_FLAG, "1")
    runner = _graph_runner(paths, method, k)
    misses = []

    def on_cache_miss(**kwargs):
        misses.append(str(kwargs.get("repr", "")))
        return False  # compile as usual

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", on_cache_miss)
    run_scenario(runner, Scenario("warm", PROMPTS, max_new_tokens=32), record_draft_logits=False)
    spec = runner.speculator
    assert spec.early_launches + spec.early_refreshes + spec.early_rebuilds > 0
    # (the write's variant that lowers the held draft plans too ran, and was warmed as well)
    assert spec.early_fused_lowerings > 0
    assert not [m for m in misses if m.startswith("_block_draft_inputs_kernel")], misses
    assert spec.early_device_lowerings > 0
    assert not [m for m in misses if m.startswith("_lower_plan_kernel")], misses
