"""The scheduler's fast paths in a speculative engine: steps in which the policy lets nobody draft
(disable_by_batch_size N reached, or "auto" with every request off) take the steady-decode
schedule and the lean no-draft update, and must equal the general paths exactly, the policy's
counters, step timing and cost model included.

Brute force as in test_scheduler_fast_path.py: random workloads (arrivals, stops, aborts, tight KV
pools that force preemption), a fake runner that accepts a random prefix of each verified block
and proposes drafts the way a block drafter (no draft pass when nobody drafts) or an
autoregressive one (always) does. At every step the scheduler is deep-copied and run with each
path; outputs and whole states must match."""
from __future__ import annotations

import dataclasses
import random

import pytest

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.spec_decode.cost_model import SPEC

from tests.utils.fake_model import EOS
from tests.utils.sched_fast_path import random_churn, schedule_both, update_both
from tests.utils.sched_helpers import make_config

K = 3


def _runner_output(s: Scheduler, so, rng: random.Random, block_drafter: bool,
                   accept: dict[str, float]) -> ModelRunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    sampled, proposed = [], []
    for req_id in req_ids:
        r = s.requests[req_id]
        samples = r.num_computed_tokens + so.num_scheduled_tokens[req_id] >= r.num_tokens
        drafts = so.scheduled_spec_decode_tokens.get(req_id, [])
        if not samples:
            sampled.append([])
            proposed.append([])
            continue
        n = 0
        while n < len(drafts) and rng.random() < accept.setdefault(req_id, rng.random()):
            n += 1
        sampled.append([EOS if rng.random() < 0.03 else rng.randrange(4, 90)
                        for _ in range(n + 1)])
        proposed.append([rng.randrange(4, 90) for _ in range(K)])
    if block_drafter and not so.propose_drafts:
        proposed = [[]] * len(req_ids)  # no draft pass: one shared empty list per row
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, spec_token_ids=proposed,
                             num_draft_tokens=[len(so.scheduled_spec_decode_tokens.get(r, []))
                                               for r in req_ids])


CASES = [(1, None), (2, None), (5, None), ("auto", 1.0), ("auto", None)]


@pytest.mark.parametrize("block_drafter", [True, False])
@pytest.mark.parametrize("policy,forced_acceptance", CASES)
@pytest.mark.parametrize("seed", range(2))
def test_spec_fast_paths_equal_general_paths(policy, forced_acceptance, block_drafter, seed):
    rng = random.Random(seed * 31 + CASES.index((policy, forced_acceptance)) * 2 + block_drafter)
    config = make_config(max_model_len=64, block_size=4, num_spec=K,
                         max_num_seqs=rng.choice([6, 8]),
                         max_num_batched_tokens=rng.choice([32, 64, 512]))
    config.speculative_config = dataclasses.replace(config.speculative_config,
                                                    disable_by_batch_size=policy)
    s = Scheduler(config, num_blocks=rng.choice([30, 48, 400]))
    if policy == "auto":
        model = s.spec_policy.cost_model
        model.acceptance_override = forced_acceptance
        model.config = dataclasses.replace(model.config, probe_interval=12,
                                           max_probe_interval=48)
        model._probe_interval = model._next_probe = 12
    counter: dict = {}
    accept: dict[str, float] = {}
    next_id = 0
    for _ in range(240):
        next_id = random_churn(s, rng, next_id, max_prompt=20, max_tokens=36)
        s, so = schedule_both(s, counter)
        out = _runner_output(s, so, rng, block_drafter, accept)
        s = update_both(s, so, out, counter)
        # A step verifying drafts costs twice a plain one (the cost model's clock).
        s.record_step_time(so, 2.0 if so.scheduled_spec_decode_tokens else 1.0)
    fast, steps = counter["fast"], counter["steps"]
    assert 0 < fast < steps, f"fast path taken in {fast} of {steps} steps"
    if policy in (1, 2) or forced_acceptance is not None:
        # Nobody drafts in most steps here: the fast path must carry a good share of them.
        assert fast >= steps // 5, f"fast path taken in only {fast} of {steps}"
    assert counter["lean"] >= fast
    stats = s.spec_policy.stats()
    assert sum(stats["num_skipped"].values()) > 0
    if policy == "auto":
        assert SPEC in str(stats["cost_model"]["step_times"])
