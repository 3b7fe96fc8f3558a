"""End-to-end exactness on the tiny model (CPU, gloo, TORCH_MLA, float32).

For every drafter, greedy speculative decoding must reproduce plain greedy decoding token for
token, at DCP = 1, 2 (interleave 4) and 4 (interleave 1), TP = DCP, with requests of different
prompt lengths arriving mid-run (prefills and decodes share batches), scripted rejections
mid-block, full acceptances, and roll-backs whose new tail sits on another rank. The oracle is
greedy decoding by full recomputation (no paged cache, no DCP, no drafts).

Request "a" is the DESIGN §6 worked example: prompt of 8 tokens, so the first verification covers
positions 8.. and accepting 1 draft leaves the accepted prefix at 10: EAGLE's first AR step has
seq_len 11 (rank-0 local 7 at N=2, I=4, not the target's stale 8) and DSpark's Q=4 block has
seq_len 14 (rank 0: 8, rank 1: 6).

One world per DCP size runs every drafter, on the session's pooled ranks (tests/utils/world_pool.py),
to keep the suite fast.
"""
from __future__ import annotations

import pytest
import torch

from tests.utils.runner_harness import (spec_tag, Scenario, greedy_oracle, make_config, make_runner, run_all_methods)
from vllm.model_executor.models.tiny import write_tiny_models
from vllm.sampling_params import SamplingParams
from vllm.forward_context import dense_attention_context

pytestmark = pytest.mark.slow

METHODS = ("eagle", "mtp", "dflash", "dspark")
# DSpark drafts k = Q = 4 tokens (the worked example's block); the others draft 3.
# "dspark+prob": sampled drafts whose q feeds probabilistic rejection sampling.
CASES = [(None, 0), ("eagle", 3), ("mtp", 3), ("dflash", 3), ("dspark", 4), ("dspark+prob", 4)]
ALL_SPEC = (*METHODS, "dspark+prob")
NUM_SPEC = dict(CASES)
PROMPTS = {
    "a": [72, 101, 108, 108, 111, 32, 119, 111],                              # 8 tokens
    "b": [84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111],       # 13 tokens
    "c": [1, 2, 3],                                                           # joins at step 2
    "d": [65, 66, 67, 68, 69],                                                # seeded sampling
}
GREEDY_IDS = ("a", "b", "c")
# Drafts to accept at each request's first verifications (-1 = all); natural drafts afterwards.
FORCED = {"a": [1, -1, 0], "b": [2, 0, -1], "c": [-1, 1]}
SCENARIO = Scenario("mixed", PROMPTS, max_new_tokens=9, arrival_step={"c": 2, "d": 1},
                    forced_accepts=FORCED,
                    sampling_params={"d": SamplingParams(temperature=0.8, seed=7, max_tokens=9)})
DCP_WORLDS = {2: 4, 4: 1}  # DCP size -> interleave


@pytest.fixture(scope="module")
def e2e(tmp_path_factory, cpu_world_pool):
    paths = write_tiny_models()  # shared cache: distilled drafters, written once per machine
    paths = {name: getattr(paths, name) for name in ("target", *METHODS)}
    oracle_runner = make_runner(make_config(paths["target"]))
    oracle = greedy_oracle(oracle_runner.model, {r: PROMPTS[r] for r in GREEDY_IDS},
                           SCENARIO.max_new_tokens)
    results = {1: run_all_methods(paths, CASES, SCENARIO, oracle)}
    stale = {}
    for dcp, interleave in DCP_WORLDS.items():
        stale_cases = ([("eagle", 3), ("dspark", 4), ("eagle", 3, "removed"),
                        ("dspark", 4, "removed")] if dcp == 2 else [])
        results[dcp], stale_results = cpu_world_pool.run_dcp_world(dcp, interleave, paths, CASES,
                                                                   SCENARIO, oracle, stale_cases)
        stale.update(stale_results)
    return {"oracle": oracle, "results": results, "stale": stale, "paths": paths}


def test_oracle_is_not_degenerate(e2e):
    # A constant continuation would make exactness trivial.
    for tokens in e2e["oracle"].values():
        assert len(set(tokens)) >= 3


@pytest.mark.parametrize("dcp", [1, 2, 4])
@pytest.mark.parametrize("method", ["plain", *ALL_SPEC])
def test_greedy_output_equals_plain_greedy(e2e, method, dcp):
    result = e2e["results"][dcp][method]
    assert {r: result.outputs[r] for r in GREEDY_IDS} == e2e["oracle"]


@pytest.mark.parametrize("dcp", [2, 4])
@pytest.mark.parametrize("method", ["plain", *ALL_SPEC])
def test_seeded_sampling_is_identical_on_every_dcp_size(e2e, method, dcp):
    """Random rows draw from per-request generators seeded alike on every rank: the sampled
    continuation (drafts verified by rejection sampling) does not depend on DCP."""
    assert e2e["results"][dcp][method].outputs["d"] == e2e["results"][1][method].outputs["d"]
    assert len(e2e["results"][1][method].outputs["d"]) == SCENARIO.max_new_tokens


@pytest.mark.parametrize("dcp", [1, 2, 4])
@pytest.mark.parametrize("method", ALL_SPEC)
def test_scripted_rejections_are_verified_exactly(e2e, method, dcp):
    result = e2e["results"][dcp][method]
    k = NUM_SPEC[method]
    for req_id, script in FORCED.items():
        expected = [k if a < 0 else a for a in script]
        assert result.accepted[req_id][: len(script)] == expected, req_id
        assert all(n == k for n in result.drafted[req_id][: len(script)])
        # Statistics stay consistent afterwards too (natural drafts).
        assert all(0 <= a <= d for a, d in zip(result.accepted[req_id], result.drafted[req_id]))


@pytest.mark.parametrize("dcp", [2, 4])
@pytest.mark.parametrize("method", ALL_SPEC)
def test_drafts_do_not_depend_on_dcp(e2e, method, dcp):
    base, other = e2e["results"][1][method], e2e["results"][dcp][method]
    assert other.proposals == base.proposals
    assert len(other.draft_logits) == len(base.draft_logits) > 0
    for ours, ref in zip(other.draft_logits, base.draft_logits):
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=0)


@pytest.mark.parametrize("dcp", [2, 4])
@pytest.mark.parametrize("method", ["plain", *ALL_SPEC])
def test_rank_local_lengths_match_global_in_every_build(e2e, method, dcp):
    result = e2e["results"][dcp][method]
    assert result.num_dcp_decode_builds > 0
    assert result.local_len_mismatches == []


def test_design_worked_example_on_rank0(e2e):
    """Row 0 is request "a". Its first verification covers positions 8..11 (G=12, target-local
    r0 = 8) and accepts 1 draft (prefix 10)."""
    builds = e2e["results"][2]["eagle"].decode_builds
    i = next(i for i, b in enumerate(builds) if b[1] and b[2][0] == 12 and b[4][0] == 4)
    assert builds[i][3][0] == 8                      # the target's local length (now stale)
    first_pass, step1 = builds[i + 1], builds[i + 2]
    assert first_pass[2][0] == 12                    # first draft pass re-reads the target rows
    assert step1[1] and set(step1[4]) == {1}         # AR step 1: one token per request
    assert step1[2][0] == 11 and step1[3][0] == 7    # the draft's own length, recomputed

    dspark = e2e["results"][2]["dspark"].decode_builds
    blocks = [b for b in dspark if not b[1]]
    assert blocks and all(b[0] == 1 and set(b[4]) == {4} for b in blocks)
    assert any(b[2][0] == 14 and b[3][0] == 8 for b in blocks)   # 9 + 1 + 4 -> r0 8
    # Target builds stay causal in group 0; the draft group only builds blocks non-causal.
    assert {b[0] for b in dspark if b[1]} <= {0, 1} and {b[0] for b in blocks} == {1}


@pytest.mark.parametrize("method", ["eagle", "dspark"])
def test_stale_target_lengths_control_is_caught(e2e, method):
    """Negative control: feeding the draft the TARGET's local lengths keeps the output exact
    (verification) but hands kernels inconsistent lengths, which the check above catches."""
    stale = e2e["stale"][method]
    assert {r: stale.outputs[r] for r in GREEDY_IDS} == e2e["oracle"]
    assert stale.local_len_mismatches
    # The stale lengths are load-bearing: the drafter attends over the wrong local KV, so its
    # logits differ from the correct DCP=2 run somewhere (kernels read the lengths handed in).
    good = e2e["results"][2][spec_tag(method)]
    assert any(a.shape != b.shape or not torch.allclose(a, b, atol=1e-4)
               for a, b in zip(stale.draft_logits, good.draft_logits))


@pytest.mark.parametrize("method", ["eagle", "dspark"])
def test_removing_the_speculator_recompute_changes_dcp_drafts(e2e, method):
    """The shared draft builder's recompute is load-bearing: with it removed (the MLA builder no
    longer recomputes behind its back; it requires the caller's lengths), the DCP=2 drafts and
    draft logits differ from the correct DCP=2 run, while verification keeps the output exact."""
    removed = e2e["stale"][f"{method}:removed"]
    good = e2e["results"][2][spec_tag(method)]
    assert {r: removed.outputs[r] for r in GREEDY_IDS} == e2e["oracle"]
    assert removed.local_len_mismatches
    assert any(a.shape != b.shape or not torch.allclose(a, b, atol=1e-4)
               for a, b in zip(removed.draft_logits, good.draft_logits))
    assert removed.proposals != good.proposals


@torch.inference_mode()
def _reference_ar_drafts(target, drafter, tokens: list[int], k: int) -> list[int]:
    """EAGLE/MTP drafts by full recomputation (no paged cache): the drafter reads (token p+1,
    target hidden p) for every accepted position, then chains its own outputs."""
    prefix = torch.tensor(tokens)                     # accepted prefix + anchor (last token)
    n = len(tokens)
    with dense_attention_context():
        hidden = target(prefix[:-1], torch.arange(n - 1))  # target hidden of the accepted prefix
        ids, feats, drafts = prefix[1:], hidden, []
        for _ in range(k):
            for_logits, for_next = drafter(ids, torch.arange(ids.shape[0]), feats)
            drafts.append(int(drafter.compute_logits(for_logits[-1:]).argmax()))
            ids = torch.cat([ids, torch.tensor(drafts[-1:])])
            feats = torch.cat([feats, for_next[-1:]])
    return drafts


@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_autoregressive_drafts_match_cache_free_reference(e2e, method):
    """The paged, rolled-back AR drafting (DCP=1) proposes exactly what a cache-free recompute of
    the drafter proposes from the same accepted prefix, at every step of every request."""
    paths = e2e["paths"]
    runner = make_runner(make_config(paths["target"], method, paths[method], k=NUM_SPEC[method]))
    result = e2e["results"][1][method]
    checked = 0
    for req_id, histories in result.histories.items():
        for tokens, proposal in zip(histories, result.proposals[req_id]):
            assert proposal == _reference_ar_drafts(runner.model, runner.draft_model, tokens,
                                                    NUM_SPEC[method]), (req_id, len(tokens))
            checked += 1
    assert checked >= 12  # every proposal of every request (about 5 per request here)
