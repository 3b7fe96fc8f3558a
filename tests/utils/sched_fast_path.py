"""Shared checks of the scheduler's fast paths against its general paths (tests/v1/core).

Each helper deep-copies the scheduler, runs one copy with the fast path off and one with it on,
asserts that the results and the whole scheduler state after the call are equal (requests, queues,
KV blocks, and for a speculative scheduler the policy's counters and cost model), and returns the
fast-path copy, from which the caller continues."""
from __future__ import annotations

import copy

from tests.utils.sched_helpers import make_request
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request import RequestStatus
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput


def scheduler_state(s: Scheduler) -> tuple:
    """Everything a step may change, in comparable form."""
    reqs = tuple(sorted(
        (r.request_id, int(r.status), r.num_computed_tokens, r.num_output_placeholders,
         tuple(r.output_token_ids), tuple(r.spec_token_ids), r.num_preemptions,
         tuple(s.kv_cache_manager.req_to_blocks.get(r.request_id, ())))
        for r in s.requests.values()))
    return (reqs, tuple(r.request_id for r in s.running), tuple(r.request_id for r in s.waiting),
            s.kv_cache_manager.num_free_blocks, sorted(s.finished_req_ids), s.num_preemptions,
            policy_state(s))


def policy_state(s: Scheduler) -> tuple | None:
    """The speculation policy's counters, its pending step timing (without the output's id,
    which differs between copies) and the cost model's whole state; the spec-decode stats."""
    policy = s.spec_policy
    if policy is None:
        return None
    timed = tuple(policy.pending_timings.values())
    model = dict(vars(policy.cost_model)) if policy.cost_model is not None else None
    stats = s.spec_decoding_stats.as_dict() if s.spec_decoding_stats is not None else None
    return (policy.num_drafted, dict(policy.num_skipped), timed, model, stats)


def schedule_both(s: Scheduler, counter: dict) -> tuple[Scheduler, object]:
    """schedule() with the steady-decode fast path off and on; counter['fast'] counts the steps
    the fast path built the output itself, counter['steps'] all steps."""
    general = copy.deepcopy(s)
    general.steady_decode_fast_path = False
    expected = general.schedule()
    probe = copy.deepcopy(s)
    took_fast = isinstance(probe._schedule_steady_decode(), SchedulerOutput)
    fast = copy.deepcopy(s)
    got = fast.schedule()
    counter["fast"] = counter.get("fast", 0) + took_fast
    counter["steps"] = counter.get("steps", 0) + 1
    assert got == expected
    assert scheduler_state(fast) == scheduler_state(general)
    return fast, got


def update_both(s: Scheduler, so, out: ModelRunnerOutput, counter: dict) -> Scheduler:
    """update_from_output with the lean no-draft update off and on: equal outputs and equal
    scheduler state; counter['lean'] counts the updates the lean pass made."""
    general = copy.deepcopy(s)
    general.plain_update_fast_path = False
    expected = general.update_from_output(so, out)
    fast = copy.deepcopy(s)
    calls = []
    lean = fast._update_from_plain_output
    fast._update_from_plain_output = lambda *a: calls.append(1) or lean(*a)
    got = fast.update_from_output(so, out)
    del fast._update_from_plain_output
    counter["lean"] = counter.get("lean", 0) + len(calls)
    assert got == expected
    assert scheduler_state(fast) == scheduler_state(general)
    return fast


def async_update_both(s: Scheduler, so, out: ModelRunnerOutput,
                      counter: dict) -> tuple[Scheduler, list]:
    """The async update with its no-stop-possible check off and on: equal outputs and equal
    scheduler state; counter['async_updates'] counts the compared updates. Returns the
    fast-check copy and its outputs."""
    general = copy.deepcopy(s)
    general.async_stop_fast_path = False
    expected = general.update_from_output(so, out)
    fast = copy.deepcopy(s)
    got = fast.update_from_output(so, out)
    counter["async_updates"] = counter.get("async_updates", 0) + 1
    assert got == expected
    assert scheduler_state(fast) == scheduler_state(general)
    return fast, got


def random_churn(s: Scheduler, rng, next_id: int, max_prompt: int, max_tokens: int) -> int:
    """One step's random traffic for the fast-vs-general comparisons: now and then (or when the
    scheduler ran dry) 1-6 new requests, some with stop ids or ignore_eos, and now and then an
    abort of a running request. Returns the next free request number."""
    if rng.random() < 0.04 or not s.has_unfinished_requests():
        for _ in range(rng.randint(1, 6)):
            stop = [rng.randrange(4, 90)] if rng.random() < 0.3 else None
            s.add_request(make_request(f"q{next_id}", [rng.randrange(4, 90) for _ in
                                                       range(rng.randint(1, max_prompt))],
                                       max_tokens=rng.randint(1, max_tokens),
                                       ignore_eos=rng.random() < 0.3,
                                       stop_token_ids=stop))
            next_id += 1
    if s.running and rng.random() < 0.05:
        s.finish_requests(rng.choice(s.running).request_id, RequestStatus.FINISHED_ABORTED)
    return next_id
