"""Async scheduling with a drafter, at the scheduler: a step that verifies no drafts is scheduled
ahead (`advanced`: counts and placeholders move at schedule time) while a verifying one is
not; nobody verifies while a step is in flight; tokens equal greedy decoding of the fake model;
and the cost model still gets the time of every timed step, although step N+1 is planned
before step N's time is known (the policy itself remembers only the last plan's record)."""
from __future__ import annotations

import dataclasses

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.spec_decode.cost_model import PLAIN, SPEC

from tests.utils.fake_model import reference_greedy
from tests.utils.sched_helpers import make_config, make_request

K = 3


def make_scheduler(disable_by_batch_size) -> Scheduler:
    cfg = make_config(max_model_len=96, block_size=4, num_spec=K)
    cfg.speculative_config = dataclasses.replace(cfg.speculative_config,
                                                 disable_by_batch_size=disable_by_batch_size)
    cfg.async_scheduling = True
    return Scheduler(cfg, num_blocks=200)


def greedy_next(tokens: list[int]) -> int:
    return reference_greedy(tokens, 1, eos=None)[0]


def runner_output(sched: Scheduler, so, history: dict[str, list[int]]) -> ModelRunnerOutput:
    """What a runner returns for `so` (the fake model's greedy tokens, every draft rejected
    except those equal to the greedy continuation), computed from the oracle history."""
    req_ids = list(so.num_scheduled_tokens)
    sampled, proposed = [], []
    for req_id in req_ids:
        r = sched.requests[req_id]
        tokens = history[req_id]
        drafts = so.scheduled_spec_decode_tokens.get(req_id, [])
        end = r.num_computed_tokens + (0 if so.advanced else so.num_scheduled_tokens[req_id]
                                       - len(drafts))
        if end < r.num_prompt_tokens:
            sampled.append([])  # an unfinished prefill chunk
            proposed.append([])
            continue
        row = []
        for draft in [*drafts, None]:
            token = greedy_next(tokens)
            row.append(token)
            tokens.append(token)
            if draft != token:
                break
        sampled.append(row)
        # Drafts: the greedy continuation (all accepted) when this step proposes.
        proposed.append(reference_greedy(list(tokens), K, eos=None) if so.propose_drafts else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled,
                             spec_token_ids=proposed)


def drive(sched: Scheduler, prompts: dict[str, list[int]], max_tokens: dict[str, int]):
    """The engine's order: a step that verifies or proposes drafts is applied before the next
    is scheduled; one that does neither stays in flight while the next is scheduled."""
    for rid, p in prompts.items():
        sched.add_request(make_request(rid, p, max_tokens=max_tokens[rid], ignore_eos=True))
    history = {rid: list(p) for rid, p in prompts.items()}
    outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
    log, pending = [], None
    clock = [0.0]

    def apply(so, ro):
        for core in sched.update_from_output(so, ro):
            outputs[core.request_id].extend(core.new_token_ids)
        clock[0] += 1.0
        sched.record_step_time(so, clock[0])  # any positive time (step_time_fn decides)

    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        in_flight = pending is not None
        so = sched.schedule()
        log.append((so, in_flight))
        # The placeholders make the history the runner sees the one of the step in flight.
        ro = runner_output(sched, so, history) if so.num_scheduled_tokens else None
        if pending is not None:
            apply(*pending)
            pending = None
        if ro is None:
            continue
        if so.advanced and not so.propose_drafts:
            pending = (so, ro)
        else:
            apply(so, ro)
    if pending is not None:
        apply(*pending)
    return outputs, log


def test_only_steps_without_drafts_are_scheduled_ahead():
    sched = make_scheduler(2)  # drafting while one request runs, none while two do
    prompts = {"a": [11, 22, 33, 44, 55], "b": [7, 8, 9]}
    lengths = {"a": 8, "b": 30}  # b drafts alone once a is done
    outputs, log = drive(sched, prompts, lengths)
    for rid, p in prompts.items():
        assert outputs[rid] == reference_greedy(p, lengths[rid], eos=None)
    verifying = [so for so, _ in log if so.scheduled_spec_decode_tokens]
    assert verifying and all(not so.advanced for so in verifying)
    assert all(so.advanced for so, _ in log if not so.scheduled_spec_decode_tokens)
    # Nothing verifies while a step is in flight.
    assert all(not so.scheduled_spec_decode_tokens for so, in_flight in log if in_flight)
    assert sum(1 for _, in_flight in log if in_flight) > 5


def test_cost_model_times_every_step_planned_ahead():
    sched = make_scheduler("auto")
    model = sched.spec_policy.cost_model
    model.acceptance_override = 1.0  # drafting cannot pay: plain steps, overlapped
    model.step_time_fn = lambda kind, batch, context: 2.0 if kind == SPEC else 1.0
    # Every step, settled ones too (the default times one settled step in 8: what is checked
    # here is that a step planned ahead finds its own timing record).
    model.config.settled_timing_interval = 1
    observed = []
    observe = model.observe_step

    def recording(kind, batch, context, seconds):
        observed.append(kind)
        observe(kind, batch, context, seconds)
    model.observe_step = recording
    prompts = {"a": [11, 22, 33, 44, 55], "b": [7, 8, 9, 10]}
    outputs, log = drive(sched, prompts, {"a": 40, "b": 40})
    for rid, p in prompts.items():
        assert outputs[rid] == reference_greedy(p, 40, eos=None)
    # A plain pure-decode step in which nobody proposes is a timed PLAIN step.
    plain_steps = [so for so, _ in log if so.num_scheduled_tokens and not so.propose_drafts
                   and all(n == 1 for n in so.num_scheduled_tokens.values())]
    planned_ahead = [so for so, in_flight in log if in_flight and not so.propose_drafts]
    assert len(planned_ahead) > 10
    assert observed.count(PLAIN) == len(plain_steps)
