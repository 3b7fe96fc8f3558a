"""The async update's no-stop-possible check (`Scheduler.async_stop_fast_path`) against the
plain `_check_stop` call for every row: random async traffic with EOS-heavy outputs, stop token
ids, ignore_eos, min_tokens, max_tokens and max_model_len caps, aborts and preemption (tight KV
pools). Every update is run on two deep copies, check off and on: equal outputs and equal
scheduler state; every kind of stop the check must not hide does happen in the traffic."""
from __future__ import annotations

import random

import pytest

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput

from tests.utils.fake_model import EOS
from tests.utils.sched_fast_path import async_update_both, random_churn
from tests.utils.sched_helpers import make_config, make_request


def _runner_output(s: Scheduler, so, rng: random.Random) -> ModelRunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        r = s.requests[req_id]
        samples = r.num_tokens + r.num_output_placeholders - r.num_computed_tokens == 1
        token = EOS if rng.random() < 0.08 else rng.randrange(4, 90)
        sampled.append([token] if samples else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


@pytest.mark.parametrize("seed", range(3))
def test_async_stop_check_equals_check_stop(seed):
    rng = random.Random(100 + seed)
    config = make_config(max_model_len=48, block_size=4, max_num_seqs=rng.choice([4, 8]),
                         max_num_batched_tokens=rng.choice([32, 512]))
    config.async_scheduling = True
    s = Scheduler(config, num_blocks=rng.choice([20, 400]))
    counter: dict = {}
    kinds = {"eos": 0, "stop_id": 0, "length": 0}
    next_id, pending = 0, None
    for _ in range(300):
        next_id = random_churn(s, rng, next_id, max_prompt=20, max_tokens=40)
        if rng.random() < 0.05:  # min_tokens holds EOS and stop ids back
            max_tokens = rng.randint(2, 30)
            s.add_request(make_request(f"m{next_id}", [rng.randrange(4, 90) for _ in range(5)],
                                       max_tokens=max_tokens,
                                       min_tokens=rng.randint(1, min(10, max_tokens)),
                                       stop_token_ids=[rng.randrange(4, 90)]))
            next_id += 1
        so = s.schedule()
        out = _runner_output(s, so, rng)
        if pending is not None:
            s, outputs = async_update_both(s, *pending, counter)
            for o in outputs:
                if o.finish_reason == "length":
                    kinds["length"] += 1
                elif o.finish_reason == "stop":
                    kinds["eos" if o.stop_reason is None else "stop_id"] += 1
        pending = (so, out)
    assert counter["async_updates"] > 250
    assert all(kinds.values()), f"some stop kind never happened: {kinds}"
