"""The speculation policy end to end on the built-in tiny model (CPU).

Whatever `speculative_config.disable_by_batch_size` decides (None, N, "auto" with a synthetic cost
that cannot pay or that pays), greedy tokens equal plain greedy decoding without speculation,
for a block drafter (DSpark: the runner skips its draft pass when nobody drafts) and an
autoregressive one (EAGLE: the draft pass always runs, the drafts are dropped). The decisions
show in the engine's stats and in /metrics.
"""
from __future__ import annotations

import re

import pytest

from tests.utils.call_probes import count_calls
from vllm import LLM, SamplingParams
from vllm.v1.spec_decode.cost_model import REASON_BATCH, REASON_COST, REASON_EXPLORE, SPEC

pytestmark = pytest.mark.slow

K = 3
PROMPTS = ["The engine", [5, 17, 29, 41, 53, 65, 77], [200, 3]]
MAX_TOKENS = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
METHODS = ("dspark", "eagle")


def make_llm(method: str | None, disable_by_batch_size=None, **kw) -> LLM:
    spec = None
    if method is not None:
        spec = {"method": method, "num_speculative_tokens": K,
                "disable_by_batch_size": disable_by_batch_size}
    return LLM(device="cpu", max_model_len=128, max_num_seqs=8, speculative_config=spec, **kw)


def count_proposes(llm: LLM) -> list[int]:
    """Wrap the speculator's propose() to count the draft passes the runner makes."""
    return count_calls(llm.llm_engine.executor.worker.model_runner.speculator, "propose")


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def metric(llm: LLM, name: str, **labels) -> float:
    """One sample of the /metrics text (upstream's exposition format)."""
    text = llm.metrics.render().decode()
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line[len(name):line.index("}")]))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics:\n{text}")


def run(method, disable_by_batch_size=None, inject=None, refills: list | None = None):
    """-> (tokens, spec-decode stats, draft passes, drafted and skipped counts from /metrics);
    `refills` receives the runner's (refill passes, tokens refilled) (context_refill.py)."""
    with make_llm(method, disable_by_batch_size) as llm:
        proposes = count_proposes(llm)
        if inject is not None:
            inject(llm.llm_engine.scheduler.spec_policy.cost_model)
        out = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        spec = llm.llm_engine.get_metrics()["spec_decode"]
        drafted = metric(llm, "vllm:spec_decode_policy_drafted_total")
        skipped = {r: metric(llm, "vllm:spec_decode_policy_skipped_total", reason=r)
                   for r in (REASON_BATCH, REASON_COST, REASON_EXPLORE)}
        if refills is not None:
            runner = llm.llm_engine.executor.worker.model_runner
            refills.append((runner.context_refills, runner.context_refill_tokens))
    return out, spec, proposes[0], drafted, skipped


@pytest.fixture(scope="module")
def plain_greedy():
    with make_llm(None) as llm:
        out = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert all(len(set(t)) >= 3 for t in out)  # a constant continuation would prove nothing
    return out


def cannot_pay(cost_model):
    # Every draft "rejected" (acceptance 1.0) and a draft+verify step twice a plain one.
    cost_model.acceptance_override = 1.0
    cost_model.step_time_fn = lambda kind, batch, context: 2.0 if kind == SPEC else 1.0


def pays(cost_model):
    # Every draft accepted and a draft+verify step 1.5 plain steps: speedup (1 + K) / 1.5.
    cost_model.acceptance_override = 1.0 + K
    cost_model.step_time_fn = lambda kind, batch, context: 1.5 if kind == SPEC else 1.0


@pytest.mark.parametrize("method", METHODS)
def test_policy_off_always_drafts(plain_greedy, method):
    out, spec, proposes, drafted, skipped = run(method)
    assert out == plain_greedy
    assert spec["policy"]["mode"] == "always" and spec["num_drafts"] > 0
    assert drafted == spec["policy"]["num_drafted"] > 0 and sum(skipped.values()) == 0


@pytest.mark.parametrize("method", METHODS)
def test_disable_by_batch_size_1_never_drafts(plain_greedy, method):
    out, spec, proposes, drafted, skipped = run(method, 1)
    assert out == plain_greedy
    assert spec["num_drafts"] == 0 and drafted == 0
    # Every decode step of every request: all tokens but the first (sampled by the prefill).
    assert skipped[REASON_BATCH] == len(PROMPTS) * (MAX_TOKENS - 1)
    if method == "dspark":
        # Only the first step (prefills, nobody running yet) drafts; then no draft pass at all.
        assert proposes == 1
    else:
        # EAGLE's draft pass writes the draft KV of the step's tokens: it always runs.
        assert proposes > MAX_TOKENS - 1


@pytest.mark.parametrize("method", METHODS)
def test_auto_stops_drafting_where_it_cannot_pay(plain_greedy, method):
    out, spec, proposes, drafted, skipped = run(method, "auto", cannot_pay)
    assert out == plain_greedy
    assert skipped[REASON_COST] > 0 and skipped[REASON_EXPLORE] > 0
    # Drafting is confined to the warm-up (two timed spec steps, two verify steps per request)
    # and one re-probe (step 32 of ~40: two steps, plus one for a second acceptance sample).
    assert spec["num_drafts"] <= 5 * len(PROMPTS) and drafted <= 6 * len(PROMPTS)
    decode_steps = drafted + sum(skipped.values())
    assert skipped[REASON_COST] >= 0.6 * decode_steps
    if method == "dspark":
        # The draft pass ran only in those steps (and after the prefill).
        assert proposes <= 8


def test_refilled_context_changes_no_decision_and_no_accepted_draft(plain_greedy, monkeypatch):
    """VLLM_DRAFT_CONTEXT_REFILL=1 under "auto" that cannot pay: the plain steps skip DSpark's
    context write and the re-probe refills it first, so its drafts, hence the accepted counts
    and every decision, are those of the engine that writes in every step (float32)."""
    from vllm.v1.worker.gpu.spec_decode.context_refill import ENV_FLAG
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv(ENV_FLAG, flag)
        refills = []
        runs[flag] = run("dspark", "auto", cannot_pay, refills) + (refills[0],)
    (out0, spec0, proposes0, drafted0, skipped0, refills0), (out1, spec1, proposes1, drafted1,
                                                              skipped1, refills1) = runs.values()
    assert out1 == out0 == plain_greedy
    assert refills0 == (0, 0) and refills1[0] >= 1 and refills1[1] >= len(PROMPTS)
    assert (spec1["num_drafts"], spec1["num_accepted_tokens"]) == (
        spec0["num_drafts"], spec0["num_accepted_tokens"])
    assert spec0["num_accepted_tokens"] > 0  # the re-probe's drafts were accepted: they count
    assert (proposes1, drafted1, skipped1) == (proposes0, drafted0, skipped0)


@pytest.mark.parametrize("method", METHODS)
def test_auto_keeps_drafting_where_it_pays(plain_greedy, method):
    out, spec, proposes, drafted, skipped = run(method, "auto", pays)
    assert out == plain_greedy
    assert skipped[REASON_COST] == 0 and skipped[REASON_EXPLORE] > 0
    assert drafted > skipped[REASON_EXPLORE] and spec["num_drafts"] > len(PROMPTS)


def test_disable_by_batch_size_follows_the_running_batch(plain_greedy):
    """N = 2 with requests of 6, 6 and 30 tokens: no drafts while two or more run, drafts once
    the long one runs alone."""
    lengths = [6, 6, 30]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    with make_llm("dspark", 2) as llm:
        engine = llm.llm_engine
        for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
            engine.add_request(str(i), prompt, p)
        finals, drafts_when = {}, []
        while engine.has_unfinished_requests():
            running = len(engine.scheduler.running)
            before = engine.get_metrics()["spec_decode"]["num_drafts"]
            for o in engine.step():
                if o.finished:
                    finals[o.request_id] = list(o.outputs[0].token_ids)
            drafts_when.append((running, engine.get_metrics()["spec_decode"]["num_drafts"] - before))
    assert [finals[str(i)] for i in range(3)] == [t[:n] for t, n in zip(plain_greedy, lengths)]
    assert all(n == 0 for running, n in drafts_when if running >= 2)
    assert sum(n for running, n in drafts_when if running == 1) > 0


def test_steps_nobody_drafts_do_what_a_plain_step_does():
    """disable_by_batch_size=1, DSpark: after the first step a decode step verifies nothing and
    proposes nothing, so it samples through the plain Sampler (the rejection sampler never runs),
    makes no draft pass, and still writes the drafter's context KV (precompute_context, every
    step) so that drafting could resume. Seeded random sampling equals the plain engine's."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    seeded = [SamplingParams(temperature=0.9, top_k=20, seed=7 + i, max_tokens=24,
                             ignore_eos=True) for i in range(len(PROMPTS))]
    with make_llm(None) as llm:
        plain = tokens(llm.generate(PROMPTS, seeded, use_tqdm=False))
    with make_llm("dspark", 1) as llm:
        runner = llm.llm_engine.executor.worker.model_runner
        proposes = count_proposes(llm)
        calls = {"verify": 0, "context": 0}
        verify, context = RejectionSampler.verify, runner.speculator.precompute_context

        def counting_verify(self, *args, **kwargs):
            calls["verify"] += 1
            return verify(self, *args, **kwargs)

        def counting_context(*args, **kwargs):
            calls["context"] += 1
            return context(*args, **kwargs)

        runner.speculator.precompute_context = counting_context
        RejectionSampler.verify = counting_verify
        try:
            out = tokens(llm.generate(PROMPTS, seeded, use_tqdm=False))
        finally:
            RejectionSampler.verify = verify
        steps = llm.llm_engine.get_metrics()["spec_decode"]["policy"]["num_skipped"]
    assert out == plain and all(len(set(t)) >= 3 for t in out)
    assert calls["verify"] == 0
    assert proposes[0] == 1  # the prefill step only (nobody ran yet)
    # One context-KV write per target forward: the prefill step plus every decode step.
    assert calls["context"] == 1 + 23 and steps[REASON_BATCH] == len(PROMPTS) * 23


def _run_counting_fast_paths(policy, inject, fast_paths: bool):
    """Greedy tokens, policy stats and the number of steps each fast path carried (scheduler
    steady decode, lean update, the runner's no-draft bookkeeping) of one DSpark run."""
    from vllm.v1.core.sched.output import SchedulerOutput
    # Synchronous: the lean update is the synchronous engine's (an async engine, the default
    # for DSpark under a policy, applies every step through _update_from_async_output).
    with make_llm("dspark", policy, async_scheduling=False) as llm:
        engine = llm.llm_engine
        sched = engine.scheduler
        if inject is not None:
            inject(sched.spec_policy.cost_model)
        sched.steady_decode_fast_path = sched.plain_update_fast_path = fast_paths
        counts = {"steady": 0, "lean": 0, "steps": 0}
        steady, lean, schedule = (sched._schedule_steady_decode, sched._update_from_plain_output,
                                  sched.schedule)

        def counted_steady():
            result = steady()
            counts["steady"] += isinstance(result, SchedulerOutput)
            return result

        def counted_lean(*args):
            counts["lean"] += 1
            return lean(*args)

        def counted_schedule():
            counts["steps"] += 1
            return schedule()
        sched._schedule_steady_decode = counted_steady
        sched._update_from_plain_output = counted_lean
        sched.schedule = counted_schedule
        out = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        spec = engine.get_metrics()["spec_decode"]
    return out, spec, counts


@pytest.mark.parametrize("policy,inject", [(1, None), ("auto", cannot_pay)])
def test_nobody_drafts_steps_take_the_fast_paths(plain_greedy, policy, inject):
    """A DSpark engine whose policy lets nobody draft schedules and updates its steps through
    the plain engine's fast paths; its greedy tokens equal plain decoding, and its policy
    stats (counts, cost-model timings on a synthetic clock) equal those of the same engine with
    the fast paths off."""
    out, spec, counts = _run_counting_fast_paths(policy, inject, True)
    ref_out, ref_spec, ref_counts = _run_counting_fast_paths(policy, inject, False)
    assert out == plain_greedy and ref_out == plain_greedy
    assert spec == ref_spec
    assert ref_counts["steady"] == ref_counts["lean"] == 0
    # Every step after the prefills is a steady decode in which (nearly always) nobody drafts.
    assert counts["steady"] >= 0.6 * counts["steps"], counts
    assert counts["lean"] >= counts["steady"], counts
