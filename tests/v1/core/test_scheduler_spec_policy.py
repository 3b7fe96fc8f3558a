"""The scheduler applies the speculation policy: a request kept from drafting is scheduled as a
plain decode (1 token, no drafts), `propose_drafts` says whether anybody needs the draft pass,
the step timing reaches the cost model only for pure decode steps, and the output is unchanged."""
import dataclasses

import pytest

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.spec_decode.cost_model import REASON_BATCH, SPEC

from tests.utils.fake_model import FakeRunner, reference_greedy
from tests.utils.sched_helpers import make_config, make_request

K = 3


def make_scheduler(disable_by_batch_size):
    cfg = make_config(max_model_len=64, block_size=4, num_spec=K)
    cfg.speculative_config = dataclasses.replace(cfg.speculative_config,
                                                 disable_by_batch_size=disable_by_batch_size)
    return Scheduler(cfg, num_blocks=200)


def step(sched, runner, seconds=None):
    so = sched.schedule()
    ro = runner.execute_model(so)
    outs = sched.update_from_output(so, ro)
    if seconds is not None:
        sched.record_step_time(so, seconds(so))
    return so, outs


def test_disable_by_batch_size_drops_drafts_while_the_batch_is_large():
    sched, runner = make_scheduler(2), FakeRunner(4, K)
    prompts = {"a": [11, 22, 33, 44, 55], "b": [7, 8, 9]}
    lengths = {"a": 4, "b": 30}
    for rid, p in prompts.items():
        sched.add_request(make_request(rid, p, max_tokens=lengths[rid], ignore_eos=True))
    outputs, log = {}, []
    while sched.has_unfinished_requests():
        running = len(sched.running)
        so, outs = step(sched, runner)
        log.append((running, so))
        for core in outs:
            outputs.setdefault(core.request_id, []).extend(core.new_token_ids)
    for rid, p in prompts.items():
        assert outputs[rid] == reference_greedy(p, lengths[rid], eos=None)
    for running, so in log:
        if running >= 2:
            # Both run: plain decodes only, and no draft pass is asked for.
            assert not so.scheduled_spec_decode_tokens and not so.propose_drafts
            assert all(n == 1 for n in so.num_scheduled_tokens.values())
    alone = [so for running, so in log if running == 1]
    assert alone and all(so.propose_drafts for so in alone)
    assert any(len(so.scheduled_spec_decode_tokens.get("b", ())) == K for so in alone)
    policy = sched.get_stats()["spec_decode"]["policy"]
    assert policy["mode"] == "batch_size" and policy["num_skipped"][REASON_BATCH] > 0


def test_auto_times_only_pure_decode_steps_and_stops_when_drafts_never_match():
    sched, runner = make_scheduler("auto"), FakeRunner(4, K)
    model = sched.spec_policy.cost_model
    model.acceptance_override = 1.0
    kinds = []

    def seconds(so):
        # The synthetic clock: a step that verifies drafts costs 2, a plain one 1.
        kinds.append(bool(so.scheduled_spec_decode_tokens))
        return 2.0 if so.scheduled_spec_decode_tokens else 1.0

    p = [11, 22, 33, 44, 55]
    sched.add_request(make_request("r", p, max_tokens=30, ignore_eos=True))
    outputs = []
    while sched.has_unfinished_requests():
        so, outs = step(sched, runner, seconds)
        for core in outs:
            outputs.extend(core.new_token_ids)
    assert outputs == reference_greedy(p, 30, eos=None)
    times = model.snapshot()["step_times"]["b1_c256"]
    assert times[SPEC]["seconds"] == 2.0 and times["plain"]["seconds"] == 1.0
    # The prefill step (and the step after a re-enable, which verifies nothing) is not timed.
    assert times[SPEC]["samples"] + times["plain"]["samples"] < len(kinds)
    # After the warm-up only the re-probe at step 32 would draft: none within 30 tokens
    # once the first few steps are past.
    assert not any(kinds[8:])


def test_auto_is_refused_where_every_rank_schedules_on_its_own():
    cfg = make_config(max_model_len=64, block_size=4, num_spec=K)
    cfg.speculative_config = dataclasses.replace(cfg.speculative_config,
                                                 disable_by_batch_size="auto")
    cfg.parallel_config.distributed_executor_backend = "external_launcher"
    with pytest.raises(ValueError, match="external_launcher.*use an int N"):
        Scheduler(cfg, num_blocks=200)
    cfg.speculative_config = dataclasses.replace(cfg.speculative_config, disable_by_batch_size=4)
    assert Scheduler(cfg, num_blocks=200).spec_policy.mode == "batch_size"
