"""The synchronous update of steps that verify drafts (`Scheduler.update_from_output`'s loop)
against a per-token reference: every sampled token appended and checked with `_check_stop`
one by one, the row finished when a check fires, the acceptance counted for rows with drafts.
The loop instead checks once per row whether any stop can fire and appends the row whole when
none can; the two must leave equal outputs and an equal scheduler state.

Random workloads on a speculative scheduler (k = 3, drafts every step, no policy): prompts
chunked over several steps, rows accepting 0..k drafts, frequent EOS and stop ids, min_tokens,
ignore_eos, small max_tokens and a small max_model_len (length caps inside a row's accepted
tokens), aborts. At every step the scheduler is deep-copied, one copy takes the engine's update
and the other the reference."""
from __future__ import annotations

import copy
import random

import pytest

from vllm.v1.core.sched.request import RequestStatus
from vllm.v1.core.sched.scheduler import EngineCoreOutput, Scheduler
from vllm.v1.outputs import ModelRunnerOutput

from tests.utils.fake_model import EOS
from tests.utils.sched_fast_path import scheduler_state
from tests.utils.sched_helpers import make_config, make_request

K = 3


def reference_update(s: Scheduler, so, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
    outputs = []
    for row, req_id in enumerate(out.req_ids):
        request = s.requests.get(req_id)
        num_scheduled = so.num_scheduled_tokens.get(req_id)
        if request is None or num_scheduled is None or request.status != RequestStatus.RUNNING:
            continue
        sampled = list(out.sampled_token_ids[row])
        drafts = so.scheduled_spec_decode_tokens.get(req_id, ())
        if request.num_computed_tokens + num_scheduled < request.num_tokens:
            assert not sampled
            request.num_computed_tokens += num_scheduled
            continue
        num_accepted = len(sampled) - 1
        request.num_computed_tokens += num_scheduled - (len(drafts) - num_accepted)
        s.spec_decoding_stats.observe(len(drafts), num_accepted)
        new_tokens = []
        for token in sampled:
            request.output_token_ids.append(token)
            new_tokens.append(token)
            if s._check_stop(request, token):
                break
        if request.is_finished():
            s.running.remove(request)
            s._free_request(request)
        else:
            request.spec_token_ids = list(out.spec_token_ids[row])
        outputs.append(EngineCoreOutput(req_id, new_tokens, request.get_finished_reason(),
                                        request.stop_reason))
    return outputs


def _runner_output(s: Scheduler, so, rng: random.Random) -> ModelRunnerOutput:
    """Tokens for every row: nothing for a prefill chunk short of the prompt's end, one token
    for a completing prefill, 1 + accepted of its drafts for a decode; fresh drafts for all."""
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = s.requests[req_id]
        n = so.num_scheduled_tokens[req_id]
        if request.num_computed_tokens + n < request.num_tokens:
            sampled.append([])
            continue
        drafts = len(so.scheduled_spec_decode_tokens.get(req_id, ()))
        count = 1 + rng.randint(0, drafts)
        # EOS and the requests' stop ids (4..89) often enough to fire inside a row
        sampled.append([EOS if rng.random() < 0.08 else rng.randrange(4, 30)
                        for _ in range(count)])
    spec = [[-1] * K for _ in req_ids]
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, spec_token_ids=spec)


@pytest.mark.parametrize("seed", range(6))
def test_verify_update_equals_per_token_reference(seed):
    rng = random.Random(seed)
    s = Scheduler(make_config(max_model_len=48, block_size=4, num_spec=K,
                              max_num_batched_tokens=rng.choice([16, 64])), num_blocks=400)
    next_id, fired, whole = 0, 0, 0
    for _ in range(250):
        if rng.random() < 0.1 or not s.has_unfinished_requests():
            for _ in range(rng.randint(1, 4)):
                stop = [rng.randrange(4, 30) for _ in range(rng.randint(1, 2))] \
                    if rng.random() < 0.3 else None
                max_tokens = rng.randint(1, 30)
                s.add_request(make_request(
                    f"q{next_id}", [rng.randrange(4, 90) for _ in range(rng.randint(1, 30))],
                    max_tokens=max_tokens, ignore_eos=rng.random() < 0.3,
                    min_tokens=min(rng.choice([0, 0, 2, 5]), max_tokens), stop_token_ids=stop))
                next_id += 1
        if s.running and rng.random() < 0.03:
            s.finish_requests(rng.choice(s.running).request_id, RequestStatus.FINISHED_ABORTED)
        so = s.schedule()
        out = _runner_output(s, so, rng)
        reference = copy.deepcopy(s)
        expected = reference_update(reference, so, out)
        got = s.update_from_output(so, out)
        assert got == expected
        assert scheduler_state(s) == scheduler_state(reference)
        assert s.spec_decoding_stats.as_dict() == reference.spec_decoding_stats.as_dict()
        fired += sum(1 for o in got if o.finished)
        whole += sum(1 for o in got if len(o.new_token_ids) > 1 and not o.finished)
    # the workload reached both branches: rows that stopped and multi-token rows kept whole
    assert fired >= 20 and whole >= 50, (fired, whole)
