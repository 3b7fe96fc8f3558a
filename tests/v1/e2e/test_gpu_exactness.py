"""GPU exactness with FLASHINFER_MLA (bfloat16): DCP = 1 on one GPU, DCP = 2 over two GPUs (NCCL).

Same scenario as the CPU suite (scripted rejections mid-block, full acceptances, a request joining
mid-run, the DESIGN §6 prefix). In bfloat16 the greedy oracle (full recomputation, no paged cache)
and the paged FlashInfer path differ by rounding, so a near-tie could flip a token without any
bug. The prompts are therefore chosen, deterministically, among candidates whose oracle
continuation keeps a top-1/top-2 logit gap of at least MIN_MARGIN at every step; on those,
any mismatch is a real error. Run on the GPU node: `pytest -m gpu tests/e2e -v`.
"""
from __future__ import annotations

import pytest
import torch

from tests.utils.runner_harness import (Scenario, greedy_oracle, make_config, make_runner, run_all_methods,
                            spawn_dcp_world, spec_tag)
from vllm.model_executor.models.tiny import write_tiny_models

pytestmark = pytest.mark.gpu

METHODS = ("eagle", "mtp", "dflash", "dspark")
CASES = [(None, 0), ("eagle", 3), ("mtp", 3), ("dflash", 3), ("dspark", 4), ("dspark+prob", 4)]
ALL_SPEC = (*METHODS, "dspark+prob")
# DCP 2 only: drafters whose KV is replicated on every rank (draft_decode_context_parallel_size=1).
REPLICATED_CASES = [("eagle", 3, 1), ("dspark", 4, 1)]
NUM_SPEC = dict(CASES)
MAX_NEW = 9
MIN_MARGIN = 0.5
FORCED = {"a": [1, -1, 0], "b": [2, 0, -1], "c": [-1, 1]}
# Candidate prompt lengths per request: "a" keeps 8 tokens (the §6 worked example).
LENGTHS = {"a": 8, "b": 13, "c": 3}
GPU_OPTIONS = dict(backend="FLASHINFER_MLA", device="cuda", dtype="bfloat16")


def _candidates(length: int, count: int = 24):
    """Slices of English prose (the built-in model is trained on text: its greedy margins are
    large there), then random byte strings."""
    from pydoc_data.topics import topics
    text = "\n".join(topics[k] for k in sorted(topics)).encode("ascii", "ignore")
    prose = [list(text[s:s + length]) for s in range(1000, 1000 + 997 * count, 997)]
    generator = torch.Generator().manual_seed(1000 + length)
    return prose + [torch.randint(0, 256, (length,), generator=generator).tolist()
                    for _ in range(count)]


@pytest.fixture(scope="module")
def gpu_setup(tmp_path_factory):
    paths = write_tiny_models()
    paths = {name: getattr(paths, name) for name in ("target", *METHODS)}
    model = make_runner(make_config(paths["target"], **GPU_OPTIONS), device="cuda").model
    prompts, oracle = {}, {}
    for req_id, length in LENGTHS.items():
        for candidate in _candidates(length):
            margins: dict[str, list[float]] = {}
            continuation = greedy_oracle(model, {req_id: candidate}, MAX_NEW, margins)
            if min(margins[req_id]) >= MIN_MARGIN:
                prompts[req_id], oracle[req_id] = candidate, continuation[req_id]
                break
        else:
            pytest.fail(f"no candidate prompt of length {length} has a greedy margin >= "
                        f"{MIN_MARGIN} for {MAX_NEW} tokens; lower MIN_MARGIN")
    scenario = Scenario("gpu", prompts, MAX_NEW, arrival_step={"c": 2}, forced_accepts=FORCED)
    return paths, scenario, oracle


@pytest.fixture(scope="module")
def dcp1_results(gpu_setup):
    paths, scenario, oracle = gpu_setup
    return run_all_methods(paths, CASES, scenario, oracle, device="cuda:0",
                           backend="FLASHINFER_MLA", dtype="bfloat16")


def _check_exact(result, oracle, method):
    assert result.outputs == oracle
    if method != "plain":
        k = NUM_SPEC[method]
        for req_id, script in FORCED.items():
            assert result.accepted[req_id][: len(script)] == [k if a < 0 else a for a in script]


@pytest.mark.parametrize("method", ["plain", *ALL_SPEC])
def test_flashinfer_dcp1_greedy_exact(gpu_setup, dcp1_results, method):
    _check_exact(dcp1_results[method], gpu_setup[2], method)


@pytest.fixture(scope="module")
def dcp2_results(gpu_setup):
    """interleave -> results of one 2-GPU world (spawned once per interleave size)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("DCP=2 over NCCL needs two GPUs")
    paths, scenario, oracle = gpu_setup
    cache: dict[int, dict] = {}

    def get(interleave: int):
        if interleave not in cache:
            cache[interleave], _ = spawn_dcp_world(2, interleave, paths,
                                                   CASES + REPLICATED_CASES, scenario, oracle,
                                                   gpu=True, timeout_s=600)
        return cache[interleave]
    return get


@pytest.mark.parametrize("interleave", [1, 4])
@pytest.mark.parametrize("method", ["plain", *ALL_SPEC])
def test_flashinfer_dcp2_two_gpus_greedy_exact(gpu_setup, dcp2_results, method, interleave):
    result = dcp2_results(interleave)[method]
    _check_exact(result, gpu_setup[2], method)
    assert result.num_dcp_decode_builds > 0 and result.local_len_mismatches == []
    # (Draft tokens are not compared with DCP=1 here: in bfloat16 a near-tie in a drafter's
    # logits may legitimately pick another draft, which changes later batches.)


@pytest.mark.parametrize("interleave", [1, 4])
@pytest.mark.parametrize("method,k,draft_dcp", REPLICATED_CASES)
def test_flashinfer_dcp2_replicated_drafter_greedy_exact(gpu_setup, dcp2_results, method, k,
                                                         draft_dcp, interleave):
    """Target DCP 2 on FLASHINFER_MLA with a drafter whose KV is replicated on both GPUs."""
    result = dcp2_results(interleave)[spec_tag(method, draft_dcp)]
    _check_exact(result, gpu_setup[2], method)
    draft = [g for g in result.kv_groups if any(n.startswith("draft_model") for n in g[0])]
    assert len(draft) == 1 and draft[0][1] is False  # the draft group is replicated
    assert result.local_len_mismatches == []
