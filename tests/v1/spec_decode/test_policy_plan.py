"""SpeculationPolicy.plan in "auto" mode hands the scheduler the cost model's decisions: per
request, or as one uniform decision when the whole batch got the same one. Either way every
request's decision, `propose`, `lets_nobody_draft` and the counts must be what the cost model's
raw decisions say (checked against a deep copy of the model, asked the same question)."""
from __future__ import annotations

import copy
import random
from collections import Counter

from vllm.v1.spec_decode.cost_model import PLAIN, SPEC, Candidate
from vllm.v1.spec_decode.policy import SpeculationPolicy


def test_auto_plan_equals_the_cost_model_decisions():
    rng = random.Random(5)
    policy = SpeculationPolicy(3, "auto")
    model = policy.cost_model
    model.config.probe_interval, model._next_probe = 6, 6
    uniform_seen = mixed_seen = 0
    for step in range(300):
        batch = rng.choice([1, 2, 5])
        cands = [Candidate(f"r{rng.randrange(8)}", rng.randrange(10, 400)) for _ in range(batch)]
        cands = list({c.req_id: c for c in cands}.values())
        raw = copy.deepcopy(model).decide(list(cands))
        plan = policy.plan(iter(cands), num_running=len(cands))
        uniform_seen += not plan.decisions
        mixed_seen += bool(plan.decisions)
        for c in cands:
            assert plan.decision(c.req_id) == raw[c.req_id]
            assert plan.drafts(c.req_id) == raw[c.req_id].draft
        assert plan.propose == any(d.draft for d in raw.values())
        assert plan.lets_nobody_draft == (not any(d.draft for d in raw.values()))
        counted = SpeculationPolicy(3, "auto")
        counted.count(plan, [c.req_id for c in cands])
        want = Counter(d.reason for d in raw.values() if not d.draft)
        assert counted.num_drafted == sum(d.draft for d in raw.values())
        assert counted.num_skipped == want
        # Feed the model: timings of both kinds, and acceptance that pays for some requests
        # (odd ids) and not for others (a request stops only on consistent evidence).
        kind = SPEC if plan.propose else PLAIN
        model.observe_step(kind, len(cands), 64, 2.0 if kind == SPEC else 1.0)
        for c in cands:
            if plan.drafts(c.req_id):
                pays = int(c.req_id[1:]) % 2 == 1
                model.observe_acceptance(c.req_id, rng.choice([3.5, 4.0] if pays else [1.0, 1.5]))
    assert uniform_seen > 20 and mixed_seen > 20, (uniform_seen, mixed_seen)
