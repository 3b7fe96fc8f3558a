"""Async scheduling with a drafter (CPU, the real runner on the built-in tiny models).

Only a step that verifies no drafts and runs no draft pass is left in flight while the next one is
scheduled; a verifying (or proposing) step is collected before the next is scheduled. Oracles:
greedy tokens equal plain greedy decoding (no drafter) and the synchronous speculative engine's,
for every drafter and speculation policy; seeded sampling, stops and preemption equal the
synchronous engine's (for "auto" with synthetic step times, which makes its decisions a function
of the step sequence; under preemption that sequence may differ, so there greedy tokens are
compared with plain greedy); and the launch order shows plain steps overlapped, verifying steps
not.
"""
from __future__ import annotations

import time

import pytest

from tests.utils.engine_steps import (collected_before_next_launch, record_launches,
                                      run_with_arrivals)
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.models.tiny import write_tiny_models
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.spec_decode.cost_model import SPEC

pytestmark = pytest.mark.slow

K = 3
METHODS = ("eagle", "mtp", "dflash", "dspark")
# disable_by_batch_size: always draft, never draft, "auto" (measured), "auto" whose drafts are
# never accepted (acceptance_override=1.0: drafting cannot pay).
POLICIES = ("always", "never", "auto", "auto_rejected")
PROMPTS = {
    "a": [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100],
    "b": [84, 104, 101, 32, 113],
    "c": [(7 * i + 11) % 250 + 4 for i in range(23)],  # longer than the 16-token budget
    "d": [65],
}


@pytest.fixture(scope="module")
def tiny():
    return write_tiny_models()


def _policy_value(policy):
    if isinstance(policy, int):
        return policy  # disable_by_batch_size=N
    return {"always": None, "never": 1}.get(policy, "auto")


def make_engine(tiny, method: str | None, policy: str, async_scheduling: bool,
                synthetic_times: bool = False, **kw) -> LLMEngine:
    spec = None
    if method is not None:
        spec = {"method": method, "model": getattr(tiny, method), "num_speculative_tokens": K,
                "disable_by_batch_size": _policy_value(policy)}
    args = dict(model=tiny.target, device="cpu", attention_backend="TORCH_MLA", seed=0,
                max_num_seqs=8, max_num_batched_tokens=16, block_size=4,
                async_scheduling=async_scheduling, speculative_config=spec)
    args.update(kw)
    engine = LLMEngine.from_engine_args(EngineArgs(**args))
    cost_model = (engine.scheduler.spec_policy.cost_model
                  if engine.scheduler.spec_policy is not None else None)
    if cost_model is not None:
        if policy == "auto_rejected":
            cost_model.acceptance_override = 1.0
        if synthetic_times:
            # Decisions from the step index only (measured host times differ run to run).
            cost_model.step_time_fn = lambda kind, batch, context: 2.0 if kind == SPEC else 1.0
    return engine


def run(engine, requests, arrivals=None) -> dict:
    return run_with_arrivals(engine, requests, arrivals, max_steps=3000, finish_once=True)


def sync_and_async(tiny, method, policy, requests, arrivals=None, **kw):
    results = []
    for mode in (False, True):
        with make_engine(tiny, method, policy, mode, **kw) as engine:
            assert engine.async_scheduling == mode
            results.append(run(engine, requests, arrivals))
    return results


def greedy_requests():
    return {rid: (p, SamplingParams(temperature=0.0, max_tokens=10 + 3 * i, ignore_eos=True))
            for i, (rid, p) in enumerate(PROMPTS.items())}


@pytest.fixture(scope="module")
def plain_greedy(tiny):
    with make_engine(tiny, None, "always", False) as engine:
        out = run(engine, greedy_requests(), arrivals={"c": 2, "d": 5})
    assert all(len(set(t)) >= 3 for t, _, _ in out.values())  # a constant run proves little
    return out


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("method", METHODS)
def test_greedy_equals_sync_and_plain_greedy(tiny, plain_greedy, method, policy):
    sync, overlapped = sync_and_async(tiny, method, policy, greedy_requests(),
                                      arrivals={"c": 2, "d": 5})
    assert sync == plain_greedy
    assert overlapped == plain_greedy


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampling_equals_sync(tiny, method, policy):
    requests = {rid: (p, SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=12,
                                        ignore_eos=True))
                for i, (rid, p) in enumerate(PROMPTS.items())}
    sync, overlapped = sync_and_async(tiny, method, policy, requests, arrivals={"b": 1, "d": 3},
                                      synthetic_times=True)
    assert overlapped == sync


@pytest.mark.parametrize("policy", ("always", "never", "auto_rejected"))
@pytest.mark.parametrize("method", ("eagle", "dspark"))
def test_stops_equal_sync(tiny, plain_greedy, method, policy):
    # Stop token / EOS / max_tokens finish a request one step before an overlapped step knows:
    # the extra step's token must not leak into the output.
    stop_tok = plain_greedy["a"][0][4]
    requests = {
        "a": (PROMPTS["a"], SamplingParams(temperature=0.0, max_tokens=20,
                                           stop_token_ids=[stop_tok])),
        "b": (PROMPTS["b"], SamplingParams(temperature=0.0, max_tokens=20)),  # EOS allowed
        "c": (PROMPTS["c"], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)),
        "d": (PROMPTS["d"], SamplingParams(temperature=0.0, max_tokens=1)),
    }
    sync, overlapped = sync_and_async(tiny, method, policy, requests, synthetic_times=True)
    assert overlapped == sync
    assert sync["a"][1] == "stop" and sync["a"][0][-1] == stop_tok
    assert len(sync["c"][0]) == 7 and len(sync["d"][0]) == 1


def preempting_run(tiny, method, policy, async_scheduling: bool, requests) -> dict:
    # 20 blocks of 4 tokens cannot hold all four requests at full length (+ k + 1 lookahead):
    # some are preempted (recomputed), possibly while a step of theirs is in flight.
    with make_engine(tiny, method, policy, async_scheduling, synthetic_times=True,
                     num_gpu_blocks_override=20, max_model_len=56) as engine:
        out = run(engine, requests)
        assert engine.scheduler.num_preemptions > 0
    return out


@pytest.mark.parametrize("policy", ("always", "never"))
@pytest.mark.parametrize("method", ("eagle", "dspark"))
def test_preemption_seeded_equals_sync(tiny, method, policy):
    requests = {rid: (p, SamplingParams(temperature=0.7, seed=7 + i, max_tokens=24,
                                        ignore_eos=True))
                for i, (rid, p) in enumerate(PROMPTS.items())}
    sync = preempting_run(tiny, method, policy, False, requests)
    assert preempting_run(tiny, method, policy, True, requests) == sync


@pytest.mark.parametrize("policy", ("auto", "auto_rejected"))
@pytest.mark.parametrize("method", ("eagle", "dspark"))
def test_preemption_greedy_equals_plain_with_auto(tiny, method, policy):
    # Under preemption the async schedule differs from the synchronous one (a request's blocks
    # are freed one step later), so "auto" may decide to draft at other steps; seeded tokens of a
    # verified step then differ from a plain step's (equal in distribution), greedy ones do not.
    requests = {rid: (p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
                for rid, p in PROMPTS.items()}
    with make_engine(tiny, None, "always", False, max_model_len=56) as engine:
        plain = run(engine, requests)
    assert preempting_run(tiny, method, policy, True, requests) == plain


@pytest.mark.parametrize("method", ("dflash", "dspark"))
def test_plain_steps_overlap_and_verifying_steps_do_not(tiny, method):
    # disable_by_batch_size=2: drafting while one request runs, none while two do. The plain
    # steps (no drafts verified, no draft pass) are launched before the previous step is
    # collected; a verifying step is collected before the next one is launched.
    with make_engine(tiny, method, 2, True) as engine:
        events = record_launches(engine)
        long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        engine.add_request("a", PROMPTS["a"], long)
        out = {}
        for step in range(400):
            if step == 3:
                engine.add_request("b", PROMPTS["b"], greedy)
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = list(o.outputs[0].token_ids)
            if not engine.has_unfinished_requests():
                break
    launches = [e for e in events if e[0] == "launch" and e[4] > 0]
    verifying = [e[1] for e in launches if e[3]]
    overlapped = [e[1] for e in launches if not e[2]]
    assert verifying and overlapped, events
    for n in verifying:
        assert collected_before_next_launch(events, n)
    for n in overlapped:
        assert not collected_before_next_launch(events, n)
    with make_engine(tiny, None, "always", False) as engine:
        plain = run(engine, {"a": (PROMPTS["a"], long), "b": (PROMPTS["b"], greedy)})
    assert out == {rid: tokens for rid, (tokens, _, _) in plain.items()}


def test_cost_model_charges_each_step_its_own_launch(tiny):
    # The cost model's step times (async, "auto" whose drafts cannot pay, a probe every 4
    # steps, so plain steps overlap and probe steps do not). Every launch is made 100 ms
    # slower: each timed step must hold exactly one launch, its own (>= 100 ms, < 180 ms: the
    # tiny model's work is ~10-20 ms on a busy 2-core box). Timing a step over the period
    # between collections charged a plain step the next step's launch as well, twice a launch
    # (>= 200 ms) where that step was launched with nothing in flight (after a verify step) or
    # is followed by a proposing one.
    from vllm.benchmarks.spec_step_kinds import set_probe_interval
    delay = 0.1
    with make_engine(tiny, "dspark", "auto_rejected", True) as engine:
        set_probe_interval(engine.scheduler.spec_policy.cost_model, 4)
        events = record_launches(engine)
        recording = engine.executor.execute_model_async

        def slow_launch(so):
            time.sleep(delay)
            return recording(so)
        engine.executor.execute_model_async = slow_launch
        recorded = []
        policy = engine.scheduler.spec_policy
        observe = policy.observe_step_time

        def recording_observe(so, seconds):
            timed = policy.pending_timings.get(id(so))
            if timed is not None and timed[0] is not None:  # None: kept for probe costs only
                recorded.append((timed[0], seconds))
            observe(so, seconds)
        policy.observe_step_time = recording_observe
        engine.add_request("a", PROMPTS["a"],
                           SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    launches = [e for e in events if e[0] == "launch" and e[4] > 0]
    overlapped = [e[1] for e in launches if not collected_before_next_launch(events, e[1])]
    kinds = {kind for kind, _ in recorded}
    assert overlapped and kinds == {"spec", "plain"}, (events, recorded)
    for kind, seconds in recorded:
        assert delay <= seconds < 1.8 * delay, (kind, seconds, recorded)
