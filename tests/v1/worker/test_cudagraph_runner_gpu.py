"""GPU: CUDA-graph replay of uniform decode/verify steps and the decode step's sync budget.

Run on the H200 node: `pytest -m gpu tests/v1/worker/test_cudagraph_runner_gpu.py`.
- greedy tokens are identical with graphs and with enforce_eager, and equal plain greedy, for
  plain decoding and all four drafters, TORCH_MLA and FLASHINFER_MLA (tiny model, DCP 1);
- a steady decode step (plain and every drafter) runs under torch.cuda.set_sync_debug_mode
  ("error") with only the runner's one device->host transfer exempted.
"""
from __future__ import annotations

import pytest

from tests.utils.runner_harness import (Scenario, greedy_oracle, make_config, make_runner,
                                        run_scenario)
from tests.utils.sync_debug import (exempt_from_sync_debug, is_decode_only,
                                     run_under_sync_debug)
from vllm.model_executor.models.tiny import write_tiny_models

pytestmark = pytest.mark.gpu

METHODS = [(None, 0), ("eagle", 3), ("mtp", 2), ("dflash", 3), ("dspark", 4)]
PROMPTS = {"a": [(7 * i + 3) % 256 for i in range(23)], "b": [(5 * i + 11) % 256 for i in range(9)],
           "c": [(3 * i + 1) % 256 for i in range(40)]}


@pytest.fixture(scope="module")
def paths():
    return write_tiny_models()


def _runner(paths, method, k, backend, eager):
    draft = getattr(paths, method) if method else None
    config = make_config(paths.target, method, draft, k=k or 3, backend=backend, device="cuda",
                         dtype="bfloat16", max_model_len=256)
    config.model_config.enforce_eager = eager
    return make_runner(config, device="cuda")


@pytest.mark.parametrize("backend", ["TORCH_MLA", "FLASHINFER_MLA"])
@pytest.mark.parametrize("method,k", METHODS, ids=[m or "plain" for m, _ in METHODS])
def test_graphs_equal_eager_and_plain_greedy(paths, backend, method, k):
    scenario = Scenario("graphs", PROMPTS, max_new_tokens=12, arrival_step={"c": 2})
    graph_runner = _runner(paths, method, k, backend, eager=False)
    assert graph_runner.cudagraphs is not None and graph_runner.cudagraphs.graphs
    replays = []
    original = graph_runner.cudagraphs.replay

    def counting(size):
        replays.append(size)
        return original(size)

    graph_runner.cudagraphs.replay = counting
    with_graphs = run_scenario(graph_runner, scenario).outputs
    assert replays, "no step replayed a graph"
    eager_runner = _runner(paths, method, k, backend, eager=True)
    assert eager_runner.cudagraphs is None
    eager = run_scenario(eager_runner, scenario).outputs
    assert with_graphs == eager
    oracle = greedy_oracle(eager_runner.model, PROMPTS, 12)
    if backend == "TORCH_MLA" or method is None:
        assert eager == oracle


@pytest.mark.parametrize("backend", ["TORCH_MLA", "FLASHINFER_MLA"])
@pytest.mark.parametrize("method,k", METHODS, ids=[m or "plain" for m, _ in METHODS])
def test_steady_decode_step_has_one_device_to_host_transfer(paths, backend, method, k):
    runner = _runner(paths, method, k, backend, eager=False)
    transfers = []
    # The one allowed transfer: sampled tokens into pinned memory, event-synchronised.
    runner._copy_step_output = exempt_from_sync_debug(runner._copy_step_output, transfers)
    steps = {"n": 0}
    real_execute = runner.execute_model

    def checked(scheduler_output):
        steps["n"] += 1
        if steps["n"] >= 4 and is_decode_only(scheduler_output):
            out = run_under_sync_debug(real_execute, scheduler_output, transfers)
            steps.setdefault("checked", 0)
            steps["checked"] += 1
            return out
        return real_execute(scheduler_output)

    runner.execute_model = checked
    scenario = Scenario("sync", {"a": PROMPTS["a"], "b": PROMPTS["b"]}, max_new_tokens=10)
    run_scenario(runner, scenario, record_draft_logits=False)
    assert steps.get("checked", 0) >= 2
