"""The scheduler's fast paths against the general ones: the steady-decode schedule
(`_schedule_steady_decode`) and the synchronous no-draft update (`_update_from_plain_output`).

Brute force: random workloads (arrivals, stops, aborts, tight KV pools that force preemption,
sync and async scheduling). At every step the scheduler is deep-copied, one copy schedules with
the fast path off and one with it on; the SchedulerOutputs and the whole scheduler state after
the call must be equal; each synchronous update is compared the same way. The run then
continues from the fast-path copy. The test also checks
that the fast path was taken in a good share of the steps (otherwise it would prove nothing).
"""
from __future__ import annotations

import random

import pytest

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput

from tests.utils.fake_model import EOS
from tests.utils.sched_fast_path import random_churn, schedule_both, update_both
from tests.utils.sched_helpers import make_config


def _sampling_rows(s: Scheduler, so, async_scheduling: bool) -> dict[str, bool]:
    rows = {}
    for req_id, n in so.num_scheduled_tokens.items():
        r = s.requests[req_id]
        if async_scheduling:  # computed counts advanced at schedule time
            rows[req_id] = r.num_tokens + r.num_output_placeholders - r.num_computed_tokens == 1
        else:
            rows[req_id] = r.num_computed_tokens + n >= r.num_tokens
    return rows


def _runner_output(so, rows: dict[str, bool], rng: random.Random) -> ModelRunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    sampled = [[EOS if rng.random() < 0.03 else rng.randrange(4, 90)] if rows[r] else []
               for r in req_ids]
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_fast_path_equals_general_path(async_scheduling, seed):
    rng = random.Random(seed * 7 + async_scheduling)
    config = make_config(max_model_len=64, block_size=4, max_num_seqs=rng.choice([4, 8, 12]),
                         max_num_batched_tokens=rng.choice([32, 64, 512]))
    config.async_scheduling = async_scheduling
    s = Scheduler(config, num_blocks=rng.choice([26, 40, 400]))
    counter = {}
    next_id, pending = 0, None
    for _ in range(300):
        next_id = random_churn(s, rng, next_id, max_prompt=24, max_tokens=40)
        s, so = schedule_both(s, counter)
        rows = _sampling_rows(s, so, async_scheduling)
        out = _runner_output(so, rows, rng)
        if async_scheduling:
            if pending is not None:
                s.update_from_output(*pending)
            pending = (so, out)
        else:
            s = update_both(s, so, out, counter)
    fast, steps = counter["fast"], counter["steps"]
    assert fast >= steps // 5, f"fast path taken in only {fast} of {steps}"
    assert fast < steps, "the general path never ran: the workload is too easy"
    if not async_scheduling:
        assert counter["lean"] == steps, "every synchronous update here has no drafts"
