"""Chunked prefill end to end on the tiny model (CPU, TORCH_MLA, float32, the real runner):
greedy outputs with prompts prefilled in chunks equal whole-prompt prefill and plain greedy
decoding, for plain decoding and all four drafters, and DCP 2 (interleave 4) / DCP 4
(interleave 1) over gloo equal DCP 1 with chunked context (the same outputs and drafts).

Prompts of 1, 6, 7, 13 and 20 tokens cross the 6-token chunk boundaries in every way (shorter,
exact, one over, several chunks); requests arrive mid-run so steps mix decode rows, prefill
chunks with cached context, and fresh prompts. Chunks of 6 tokens exceed 1 + k for every
drafter, so continuation chunks take the prefill path (context read from the paged cache);
chunks of 4 make them decode rows (absorbed path) when k >= 3.
"""
from __future__ import annotations

import dataclasses

import pytest

from tests.utils.runner_harness import (Scenario, greedy_oracle, make_config, make_runner,
                                        run_all_methods)
from vllm.model_executor.models.tiny import write_tiny_models

pytestmark = pytest.mark.slow

METHODS = ("eagle", "mtp", "dflash", "dspark")
CASES = [(None, 0), ("eagle", 3), ("mtp", 3), ("dflash", 3), ("dspark", 4)]
PROMPTS = {
    "long": [(7 * i * i + 3 * i + 11) % 250 + 4 for i in range(20)],
    "mid": [(5 * i + 101) % 250 + 4 for i in range(13)],
    "one_over": [84, 104, 101, 32, 113, 117, 105],
    "exact": [72, 101, 108, 108, 111, 32],
    "single": [65],
}
WHOLE = Scenario("whole", PROMPTS, max_new_tokens=7, arrival_step={"mid": 1, "single": 2,
                                                                    "exact": 3})
CHUNKED = dataclasses.replace(WHOLE, name="chunked6", prefill_chunk=6)
CHUNKED4 = dataclasses.replace(WHOLE, name="chunked4", prefill_chunk=4)


@pytest.fixture(scope="module")
def runs(cpu_world_pool):
    paths = write_tiny_models()
    paths = {name: getattr(paths, name) for name in ("target", *METHODS)}
    oracle = greedy_oracle(make_runner(make_config(paths["target"])).model, PROMPTS,
                           WHOLE.max_new_tokens)
    results = {(1, sc.name): run_all_methods(paths, CASES, sc, oracle)
               for sc in (WHOLE, CHUNKED, CHUNKED4)}
    for dcp, interleave in ((2, 4), (4, 1)):
        results[(dcp, CHUNKED.name)], _ = cpu_world_pool.run_dcp_world(dcp, interleave, paths,
                                                                       CASES, CHUNKED, oracle)
    return oracle, results


@pytest.mark.parametrize("scenario", ["chunked6", "chunked4"])
@pytest.mark.parametrize("method", ["plain", *METHODS])
def test_chunked_greedy_equals_whole_prompt_and_plain_greedy(runs, method, scenario):
    oracle, results = runs
    chunked, whole = results[(1, scenario)][method], results[(1, "whole")][method]
    assert whole.outputs == oracle
    assert chunked.outputs == oracle
    assert chunked.num_partial_prefill_rows > 0 and whole.num_partial_prefill_rows == 0
    # Drafting starts when the prefill finishes, from the same target states: same drafts.
    assert chunked.proposals == whole.proposals


@pytest.mark.parametrize("dcp", [2, 4])
@pytest.mark.parametrize("method", ["plain", *METHODS])
def test_dcp_with_chunked_context_equals_dcp1(runs, method, dcp):
    oracle, results = runs
    ours, base = results[(dcp, "chunked6")][method], results[(1, "chunked6")][method]
    assert ours.outputs == oracle
    assert ours.proposals == base.proposals
    assert ours.local_len_mismatches == []
