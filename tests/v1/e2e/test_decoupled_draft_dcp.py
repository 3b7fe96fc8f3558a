"""Decoupled draft parallelism end to end (upstream RFC #53673 / PR #56723), CPU over gloo.

Target `-tp 2 -dcp 2` (TORCH_MLA, float32, the real runner) with a REPLICATED drafter
(`draft_decode_context_parallel_size=1`: every rank keeps the full draft context and drafts over
it locally, no LSE merge) must give plain greedy output token for token, the same output as the
all-DCP run (drafter sharded like the target), and the same drafts. Prompts are prefilled in
chunks of 6 so the replicated group also serves prefill rows with cached context.
"""
from __future__ import annotations

import pytest

from tests.utils.runner_harness import (NUM_BLOCKS, Scenario, greedy_oracle, make_config,
                                        make_runner, spec_tag)
from vllm.model_executor.models.tiny import write_tiny_models

pytestmark = pytest.mark.slow

DCP = 2
# EAGLE (causal, shares the target's geometry) and DSpark (non-causal blocks) as the issue asks;
# MTP and DFlash go through the same generic path.
DRAFTERS = (("eagle", 3), ("dspark", 4), ("mtp", 3), ("dflash", 3))
CASES = [(None, 0)] + [c for m, k in DRAFTERS for c in ((m, k), (m, k, 1))]
PROMPTS = {
    "long": [(7 * i * i + 3 * i + 11) % 250 + 4 for i in range(14)],
    "short": [84, 104, 101, 32, 113],
    "single": [65],
}
SCENARIO = Scenario("decoupled", PROMPTS, max_new_tokens=6, arrival_step={"single": 1},
                    prefill_chunk=6)


@pytest.fixture(scope="module")
def runs(cpu_world_pool):
    paths = write_tiny_models()
    paths = {name: getattr(paths, name) for name in ("target", *(m for m, _ in DRAFTERS))}
    oracle = greedy_oracle(make_runner(make_config(paths["target"])).model, PROMPTS,
                           SCENARIO.max_new_tokens)
    results, _ = cpu_world_pool.run_dcp_world(DCP, 1, paths, CASES, SCENARIO, oracle)
    return oracle, results


def _draft_group(result):
    """(layer names, dcp_sharded, pages per layer) of the group holding the drafter's layers
    (they carry the "draft_model" prefix; a sharded causal EAGLE may share the target's group)."""
    groups = [g for g in result.kv_groups if any(n.startswith("draft_model") for n in g[0])]
    assert len(groups) == 1, result.kv_groups
    return groups[0]


def test_plain_dcp_run_is_plain_greedy(runs):
    oracle, results = runs
    assert results["plain"].outputs == oracle


@pytest.mark.parametrize("method", [m for m, _ in DRAFTERS])
def test_replicated_drafter_equals_plain_greedy_and_all_dcp_run(runs, method):
    oracle, results = runs
    replicated, sharded = results[spec_tag(method, 1)], results[spec_tag(method)]
    assert replicated.outputs == oracle
    assert sharded.outputs == oracle
    # The same drafts: the replicated drafter reads the full context exactly as the sharded one
    # reads it through the LSE merge.
    assert replicated.proposals == sharded.proposals
    assert sum(map(sum, replicated.accepted.values())) > 0  # drafts were verified and accepted
    # Its KV group is replicated and priced per rank at the full context (dcp pages per id);
    # the all-DCP run keeps it sharded like the target.
    names, dcp_sharded, pages = _draft_group(replicated)
    assert not dcp_sharded and pages == DCP * NUM_BLOCKS
    assert all(n.startswith("draft_model") for n in names)  # never merged with target layers
    assert all(g[1] and g[2] == NUM_BLOCKS for g in replicated.kv_groups if g[0] != names)
    _, dcp_sharded, pages = _draft_group(sharded)
    assert dcp_sharded and pages == NUM_BLOCKS
    assert sharded.local_len_mismatches == [] and replicated.local_len_mismatches == []
