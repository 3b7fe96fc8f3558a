"""The speculation policy and its cost model under synthetic step times and acceptance.

A small loop plays the scheduler/engine protocol exactly as vllm/v1/core/sched/scheduler.py does:
plan the step, drop the drafts of requests that do not draft, time the step (a synthetic clock:
t_spec for a draft+verify step, t_plain for a plain one, their mean for a mixed one), observe the
acceptance of the requests that verified drafts, and give every request drafts for the next step
iff the drafter ran. The expectations are the arithmetic of the rule (speedup = a * t_plain /
t_spec), not numbers taken from the code under test.
"""
from __future__ import annotations

import pytest

from vllm.config import SpeculativeConfig
from vllm.v1.spec_decode.cost_model import (PLAIN, REASON_BATCH, REASON_COST, REASON_EXPLORE,
                                            SPEC, Candidate, CostModelConfig, Decision,
                                            SpeculationCostModel, pow2_bucket)
from vllm.v1.spec_decode.policy import SpeculationPolicy, StepPlan

K = 4


class Loop:
    """Requests with fixed contexts and a per-request acceptance length (callable of step)."""

    def __init__(self, policy: SpeculationPolicy, acceptance: dict, t_spec=2.0, t_plain=1.0,
                 context=1000, t_switch_plain=None, t_switch_spec=None):
        self.policy, self.acceptance = policy, acceptance
        self.t_spec, self.t_plain, self.context = t_spec, t_plain, context
        # A plain step right after a step that was not plain (the switch; None: t_plain).
        self.t_switch_plain = t_switch_plain
        # A step that drafts or verifies right after a plain step (a probe's first; None: as
        # any other).
        self.t_switch_spec = t_switch_spec
        self.last_plain = False
        self.has_drafts = {r: False for r in acceptance}
        self.step = 0
        self.log: list[dict[str, bool]] = []   # per step: request -> verified drafts
        self.proposed: list[bool] = []
        self.seconds: list[float] = []  # each step's simulated time
        self.num_plain = 0  # plain steps timed so far

    def run(self, steps: int) -> Loop:
        for _ in range(steps):
            self.one_step()
        return self

    def one_step(self) -> None:
        policy = self.policy
        reqs = list(self.acceptance)
        plan = policy.plan([Candidate(r, self.context) for r in reqs], num_running=len(reqs))
        verified = {r: self.has_drafts[r] and plan.drafts(r) for r in reqs}
        output = object()
        policy.count(plan, reqs)
        policy.plan_timing(output, plan, {r: K if verified[r] else 0 for r in reqs},
                           [self.context] * len(reqs), pure_decode=True)
        spec_rows = sum(verified.values())
        t_plain = self.t_plain(self.num_plain) if callable(self.t_plain) else self.t_plain
        if plan.propose and spec_rows == len(reqs):
            seconds = self.t_spec
        elif not plan.propose and spec_rows == 0:
            seconds = t_plain  # t_plain may be a callable of the plain-step count
            if self.t_switch_plain is not None and not self.last_plain:
                seconds = max(seconds, self.t_switch_plain)
            self.num_plain += 1
        else:
            seconds = (self.t_spec + t_plain) / 2
        if self.t_switch_spec is not None and self.last_plain and (plan.propose or spec_rows):
            seconds = max(seconds, self.t_switch_spec)
        self.last_plain = not plan.propose and spec_rows == 0
        self.seconds.append(seconds)
        policy.observe_step_time(output, seconds)
        for r in reqs:
            if verified[r]:
                a = self.acceptance[r]
                a = a(self.step) if callable(a) else a
                policy.observe_acceptance(r, K, int(round(a)) - 1)
            self.has_drafts[r] = plan.propose  # the runner drafts for every row or none
        self.log.append(verified)
        self.proposed.append(plan.propose)
        self.step += 1

    def drafted_steps(self, req: str, since: int = 0) -> int:
        return sum(entry[req] for entry in self.log[since:])

    def plain_runs(self, since: int, until: int) -> list[list[int]]:
        """Runs of consecutive steps in [since, until) where nobody proposed (while everyone
        drafts: the plain re-probes; each costs its steps and the next, which proposes with
        nothing to verify)."""
        runs: list[list[int]] = []
        for i in range(since, until):
            if not self.proposed[i]:
                if runs and runs[-1][-1] == i - 1:
                    runs[-1].append(i)
                else:
                    runs.append([i])
        return runs

    def undrafted_by_plain_runs(self, runs: list[list[int]], until: int) -> list[int]:
        """The steps a plain run leaves without verified drafts: its own and the next."""
        return sorted(i for run in runs for i in run + [run[-1] + 1] if i < until)

    def undrafted(self, since: int, until: int) -> list[int]:
        return [i for i in range(since, until) if not all(self.log[i].values())]


def auto_policy(**cfg) -> SpeculationPolicy:
    return SpeculationPolicy(K, "auto", SpeculationCostModel(K, CostModelConfig(**cfg)))


def test_pow2_buckets():
    assert [pow2_bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 1000, 1024, 1025)] == \
        [1, 1, 2, 4, 4, 8, 8, 16, 1024, 1024, 2048]
    model = SpeculationCostModel(K, CostModelConfig(min_context_bucket=256))
    assert model.bucket(3, 10) == (4, 256) and model.bucket(1, 3000) == (1, 4096)


def test_stops_drafting_where_it_cannot_pay():
    # acceptance 1.0 (every draft rejected), a draft+verify step costs 1.5 plain steps.
    loop = Loop(auto_policy(probe_interval=64), {"a": 1.0, "b": 1.0}, t_spec=1.5).run(600)
    # Warm-up: spec timings, the plain exploration, the acceptance of one verify step.
    assert all(not any(entry.values()) for entry in loop.log[10:64])
    assert not any(loop.proposed[10:64])
    # Afterwards only re-probes draft, each probe_len = 2 steps plus one to get the second
    # acceptance sample, at doubling intervals (64, 128, 256, 512 steps): at most 5 probes.
    late = sum(loop.proposed[10:])
    assert 0 < late <= 5 * 3
    stats = loop.policy.stats()
    assert stats["num_skipped"][REASON_COST] > 1000
    # One exploration run of plain steps (max(min_samples, plain_run_len)), 2 requests.
    cfg = CostModelConfig()
    assert stats["num_skipped"][REASON_EXPLORE] == max(cfg.min_samples, cfg.plain_run_len) * 2


def test_keeps_drafting_where_it_pays():
    # 3 tokens per step for 1.5x the cost: speedup 2.
    loop = Loop(auto_policy(), {"a": 3.0, "b": 3.0}, t_spec=1.5).run(300)
    assert loop.policy.stats()["num_skipped"].get(REASON_COST, 0) == 0
    # Only the exploration's plain steps, the plain re-probes, and the step after each (it
    # proposes but has nothing to verify) go without drafts.
    runs = loop.plain_runs(10, 300)
    assert loop.undrafted(10, 300) == loop.undrafted_by_plain_runs(runs, 300)
    # Each re-probe is a run of plain_run_len plain steps (the first after drafting pays the
    # switch; the module doc says why).
    assert [len(run) for run in runs] == [CostModelConfig().plain_run_len] * len(runs)
    # The ratio never moves, so the re-probe interval doubles: 32, 64, 128 steps.
    starts = [run[0] for run in runs]
    assert [b - a for a, b in zip(starts, starts[1:])] == [64, 128]
    assert loop.drafted_steps("a") >= 300 - 6 - sum(len(run) + 1 for run in runs)


def test_plain_reprobes_correct_a_plain_time_that_exploration_measured_too_high():
    # Every exploration plain step pays a one-time cost (10x); drafting cannot pay
    # (acceptance 1, a spec step costs 1.5 plain steps). With t_plain = 10 the model would
    # draft forever; the first plain re-probe while everyone drafts brings it down to 1.
    run = CostModelConfig().plain_run_len
    loop = Loop(auto_policy(), {"a": 1.0, "b": 1.0}, t_spec=1.5,
                t_plain=lambda n: 10.0 if n < run else 1.0).run(600)
    assert all(loop.log[i]["a"] for i in range(10, 30))  # drafting on the bad estimate
    stopped = next(i for i in range(10, 600) if not any(loop.proposed[i:i + 20]))
    # The re-probe at step ~32 measures 1: the bucket's time is the minimum of [10, .., 1].
    assert stopped <= 40
    assert loop.drafted_steps("a", stopped) <= 5 * 3  # then only the spec re-probes draft


@pytest.mark.parametrize("plain_run_len", [1, 3])
def test_plain_runs_outlast_the_switch_from_drafting(plain_run_len):
    # As on the H200 (ninth session): the exploration's plain steps pay one-time costs, and the
    # first plain step after a verify step pays the switch (1.6 against 1.0, dearer than a
    # spec step of 1.5). A re-probe of one step then measures 1.6: ratio 1.5 / 1.6 < 1, and an
    # engine whose drafts cannot pay (acceptance 1) drafts on. A run of 3 measures the steady
    # steps after the switch too, and it stops.
    loop = Loop(auto_policy(plain_run_len=plain_run_len), {"a": 1.0, "b": 1.0}, t_spec=1.5,
                t_plain=lambda n: 10.0 if n < max(2, plain_run_len) else 1.0,
                t_switch_plain=1.6).run(600)
    stopped = next((i for i in range(10, 580) if not any(loop.proposed[i:i + 20])), None)
    if plain_run_len == 1:
        assert stopped is None
        assert loop.drafted_steps("a", 100) > 400
    else:
        assert stopped is not None and stopped <= 40
        assert loop.drafted_steps("a", stopped) <= 5 * 3  # then only the spec re-probes draft


def test_per_request_decisions_in_one_batch():
    # t_spec / t_plain = 1.5: "good" gains 3 tokens (speedup 2), "bad" 1 token (0.67).
    loop = Loop(auto_policy(probe_interval=500, max_probe_interval=500),
                {"good": 3.0, "bad": 1.0}, t_spec=1.5).run(200)
    assert all(entry["good"] for entry in loop.log[10:])
    assert not any(entry["bad"] for entry in loop.log[10:])
    assert all(loop.proposed[10:])  # the drafter still runs for "good"


def test_hysteresis_keeps_the_current_state_inside_the_band():
    h = 0.05
    model = SpeculationCostModel(K, CostModelConfig(hysteresis=h, probe_interval=10**6,
                                                    max_probe_interval=10**6,
                                                    min_acceptance_samples=1))
    for _ in range(3):
        model.observe_step(SPEC, 1, 500, 2.0)
        model.observe_step(PLAIN, 1, 500, 1.0)
    cand = [Candidate("r", 500)]
    # speedup = a / 2. A drafting request keeps drafting at speedup 0.97 (inside the band)...
    model.observe_acceptance("r", 1.94)
    assert model.decide(cand)["r"].draft
    # ...and stops below 1 - h.
    model = SpeculationCostModel(K, model.config)
    for _ in range(3):
        model.observe_step(SPEC, 1, 500, 2.0)
        model.observe_step(PLAIN, 1, 500, 1.0)
    model.observe_acceptance("r", 1.8)  # speedup 0.9
    assert not model.decide(cand)["r"].draft
    # Back to 2.06 (speedup 1.03, inside the band): it stays off; 2.2 (1.1) restarts it.
    model.config.acceptance_alpha = 1.0
    model.observe_acceptance("r", 2.06)
    assert not model.decide(cand)["r"].draft
    model.observe_acceptance("r", 2.2)
    assert model.decide(cand)["r"].draft


def test_one_verify_step_is_not_enough_to_judge_a_request():
    model = SpeculationCostModel(K, CostModelConfig(min_acceptance_samples=2))
    for _ in range(2):
        model.observe_step(SPEC, 1, 500, 2.0)
        model.observe_step(PLAIN, 1, 500, 1.0)
    cand = [Candidate("r", 500)]
    model.observe_acceptance("r", 1.0)
    assert model.decide(cand)["r"].draft and model.acceptance("r") is None
    model.observe_acceptance("r", 1.0)
    assert model.decide(cand)["r"] == Decision(False, REASON_COST)


def noisy_acceptance(mean_of: tuple[int, ...], seed: int):
    """Per-step acceptance lengths drawn uniformly from `mean_of` (a verify step gains 1..k+1
    tokens: one step says little about the request)."""
    import random
    rng = random.Random(seed)
    return lambda step: float(rng.choice(mean_of))


@pytest.mark.parametrize("seed", range(12))
def test_noisy_acceptance_that_pays_keeps_drafting(seed):
    # Acceptance 1..5 per step, mean 3 (the tiny DSpark drafter's on the H200), a spec step
    # 2.2 plain ones: drafting pays 3 / 2.2 = 1.36x. One unlucky first sample (a 1 or a 2,
    # 40 % of them) must not stop a request that pays, nor must probes judged on one or two.
    acceptance = {"a": noisy_acceptance((1, 2, 3, 4, 5), seed)}
    loop = Loop(auto_policy(), acceptance, t_spec=2.2).run(400)
    assert loop.drafted_steps("a", 10) >= 0.8 * 390, loop.policy.stats()


@pytest.mark.parametrize("seed", range(6))
def test_noisy_acceptance_that_loses_a_little_still_stops(seed):
    # Mean 4/3 (1, 1 or 2) against a cost ratio of 1.5: drafting loses 11 %, inside twice the
    # hysteresis band of a confident estimate. The stop rule's margin must not keep such a
    # request drafting: it stops for most of the run (probes and unlucky streaks aside).
    acceptance = {"a": noisy_acceptance((1, 1, 2), seed)}
    loop = Loop(auto_policy(), acceptance, t_spec=1.5).run(400)
    assert loop.drafted_steps("a", 10) <= 0.25 * 390, loop.policy.stats()


def test_a_poor_start_gets_a_second_look_at_the_next_probe():
    # Drafts useless for the first 20 steps (right after the prompt), then 3 tokens per step at
    # 2.2x the cost (pays 1.36x). The request stops on its first samples; the first probe
    # (probe_interval = 32) may not wait for the budget's spacing (5 * 1.2 / 0.02 = 300 steps).
    acceptance = {"a": lambda step: 1.0 if step < 20 else 3.0}
    loop = Loop(auto_policy(), acceptance, t_spec=2.2).run(200)
    assert not any(loop.log[i]["a"] for i in range(14, 30))  # it stopped
    # Revived by the probe at step 32: from then on it drafts but for the plain re-probes.
    assert loop.drafted_steps("a", 30) - loop.drafted_steps("a", 100) >= 50


@pytest.mark.parametrize("seed", range(6))
def test_noisy_acceptance_that_cannot_pay_stops(seed):
    # Mean 1.5 (1 or 2) against a cost ratio of 2.2: drafting loses (0.68x).
    acceptance = {"a": noisy_acceptance((1, 2), seed)}
    loop = Loop(auto_policy(), acceptance, t_spec=2.2).run(400)
    assert loop.drafted_steps("a", 10) <= 0.1 * 390, loop.policy.stats()


def test_reprobe_revives_a_request_whose_drafts_started_to_match():
    # Acceptance 1 for 150 steps, then 4 (speedup 4 / 1.5 = 2.7).
    acceptance = {"a": lambda step: 1.0 if step < 150 else 4.0}
    loop = Loop(auto_policy(probe_interval=32, max_probe_interval=256), acceptance,
                t_spec=1.5).run(600)
    off_steps = [i for i in range(10, 150) if not loop.log[i]["a"]]
    assert len(off_steps) > 100  # it stopped
    # Probes happened while off (drafts verified now and then before step 150)...
    assert 0 < loop.drafted_steps("a", 10) - loop.drafted_steps("a", 150) <= 10
    # ...and the first probe after the change revives it for good (the interval was at most
    # 256 by then, so within 256 + 2 steps).
    revived = next(i for i in range(150, 600) if all(loop.log[j]["a"] for j in range(i, i + 30)))
    assert revived <= 150 + 256 + 3
    # From then on it drafts but for the plain re-probes (and the step after each).
    runs = loop.plain_runs(revived, 600)
    assert loop.undrafted(revived, 600) == loop.undrafted_by_plain_runs(runs, 600)
    assert len(runs) <= 4


def test_probe_interval_backs_off_while_nobody_revives():
    # (probe_budget=None: the interval alone; the cost-based floor has its own test.)
    loop = Loop(auto_policy(probe_interval=16, max_probe_interval=64, probe_budget=None),
                {"a": 1.0}, t_spec=2.0).run(400)
    probe_starts = [i for i in range(10, 400) if loop.proposed[i] and not loop.proposed[i - 1]]
    gaps = [b - a for a, b in zip(probe_starts, probe_starts[1:])]
    assert gaps[:3] == [32, 64, 64] or gaps[:2] == [32, 64], gaps
    assert max(gaps) == 64


def test_probes_while_everyone_drafts_do_not_back_off():
    # Acceptance 4 (pays) for 300 steps, then 1: the first probe after the switch comes within
    # probe_interval + probe_len steps, not after a backed-off interval.
    acceptance = {"a": lambda step: 4.0 if step < 300 else 1.0,
                  "b": lambda step: 4.0 if step < 300 else 1.0}
    loop = Loop(auto_policy(probe_interval=16, max_probe_interval=1024, probe_budget=None),
                acceptance, t_spec=1.5).run(400)
    runs = loop.plain_runs(10, 300)
    assert loop.undrafted(10, 300) == loop.undrafted_by_plain_runs(runs, 300)
    assert len(runs) <= 5  # 16 .. 256 steps apart (doubling; the ratio never moves)
    stopped = next(i for i in range(300, 400) if not loop.proposed[i]
                   and not loop.proposed[i + 1])
    first_probe = next(i for i in range(stopped, 400) if loop.proposed[i])
    assert first_probe - stopped <= 16 + 2


def _loop_time(loop: Loop, since: int, until: int) -> float:
    """Simulated time of steps [since, until), priced as Loop.one_step prices them."""
    total = 0.0
    for proposed, verified in zip(loop.proposed[since:until], loop.log[since:until]):
        rows = sum(verified.values())
        if proposed and rows == len(verified):
            total += loop.t_spec
        elif not proposed and rows == 0:
            total += loop.t_plain
        else:
            total += (loop.t_spec + loop.t_plain) / 2
    return total


@pytest.mark.parametrize("t_spec", [1.5, 2.0, 4.0])
def test_probing_where_drafting_cannot_pay_costs_at_most_the_probe_budget(t_spec):
    # Drafts never accepted: after the start (drafting to measure, exploration) the engine
    # runs plain steps and re-probes. With the default config the probes' cost stays within
    # probe_budget (2 %) of all-plain time plus one probe (the credit starts full), whatever
    # a speculative step costs; without the
    # cost-based spacing (32, doubling) the dear steps of the tiny model at B=8 (t_spec ~4
    # t_plain) cost far more in the first hundreds of steps.
    since, until = 20, 2020
    loop = Loop(auto_policy(), {"a": 1.0, "b": 1.0}, t_spec=t_spec).run(until)
    cfg = CostModelConfig()
    budget = cfg.probe_budget
    one_probe = (cfg.probe_len + cfg.min_acceptance_samples - 1) * (t_spec - 1.0)
    assert any(loop.proposed[since:until])  # it still probes
    assert _loop_time(loop, since, until) <= (1 + budget) * (until - since) + one_probe
    if t_spec == 4.0:
        loose = Loop(auto_policy(probe_budget=None), {"a": 1.0, "b": 1.0}, t_spec=t_spec)
        loose.run(600)
        assert _loop_time(loose, since, 600) > (1 + 2 * budget) * (600 - since)


@pytest.mark.parametrize("t_switch_spec", [6.0, 12.0])
def test_probes_are_charged_what_they_cost(t_switch_spec):
    # On the GPU a probe's first step costs far more than a steady speculative step (it runs
    # synchronously and re-plans: 3-7 ms against 0.7 ms plain and ~2 ms steady speculative,
    # tiny model at B=8, twelfth session). Charged what its steps measured, probing where
    # drafting cannot pay stays within probe_budget of all-plain time plus the first probe
    # (the credit starts full); charged the estimate from t_spec it cost several times that.
    since, until = 20, 4020
    t_spec = 2.0
    loop = Loop(auto_policy(), {"a": 1.0, "b": 1.0}, t_spec=t_spec,
                t_switch_spec=t_switch_spec).run(until)
    cfg = CostModelConfig()
    # A probe: a propose-only first step (the switch), probe_len + min_acceptance_samples - 2
    # verify steps, then the plain step back; in plain steps beyond the ones it replaces:
    one_probe = (t_switch_spec - 1.0) + (cfg.probe_len + cfg.min_acceptance_samples - 2) * (
        t_spec - 1.0)
    probes = [i for i in range(since, until) if loop.proposed[i] and not loop.proposed[i - 1]]
    assert len(probes) >= 2  # it still probes
    assert sum(loop.seconds[since:until]) <= (1 + cfg.probe_budget) * (until - since) + one_probe
    charged = loop.policy.cost_model.probe_costs
    assert charged and all(m == pytest.approx(one_probe) for _, _, m in charged), charged


def test_the_probe_budget_spaces_probes_by_their_cost():
    # Floor = a probe's measured cost in plain steps / budget. The probe: a propose-only
    # first step (priced (t_spec + t_plain) / 2 here: 0.5 plain steps dearer), then
    # probe_len + min_acceptance_samples - 2 = 2 verify steps (1 dearer each), then the plain
    # step back: 2.5 / 0.02 = 125 steps at t_spec = 2 t_plain. (The estimate the first probe
    # is charged, 3 steps of t_spec, would space them 150 apart.)
    loop = Loop(auto_policy(probe_interval=16, max_probe_interval=64, min_acceptance_samples=2),
                {"a": 1.0}, t_spec=2.0).run(1000)
    starts = [i for i in range(10, 1000) if loop.proposed[i] and not loop.proposed[i - 1]]
    assert len(starts) >= 5
    assert min(b - a for a, b in zip(starts, starts[1:])) >= 125, starts


def test_explores_plain_steps_before_trusting_a_bucket():
    model = SpeculationCostModel(K, CostModelConfig(min_samples=3))
    cand = [Candidate("r", 100)]
    assert model.decide(cand)["r"].draft          # no timings at all: draft and measure
    for _ in range(3):
        model.observe_step(SPEC, 1, 100, 2.0)
    reasons = [model.decide(cand)["r"] for _ in range(3)]
    assert all(not d.draft and d.reason == REASON_EXPLORE for d in reasons)
    # A new bucket (batch 3 -> bucket 4) while no bucket has both timings: it drafts to measure.
    assert all(d.draft for d in model.decide([Candidate(f"q{i}", 100) for i in range(3)])
               .values())


def test_a_new_bucket_borrows_the_nearest_measured_ratio():
    model = SpeculationCostModel(K, CostModelConfig(min_samples=2, min_acceptance_samples=1))
    for _ in range(2):
        model.observe_step(SPEC, 1, 100, 3.0)    # bucket (1, 256): ratio 3
        model.observe_step(PLAIN, 1, 100, 1.0)
        model.observe_step(SPEC, 64, 100, 1.2)   # bucket (64, 256): ratio 1.2
        model.observe_step(PLAIN, 64, 100, 1.0)
    assert model.cost_ratio(1, 100) == pytest.approx(3.0)
    assert model.cost_ratio(2, 100) == pytest.approx(3.0)     # nearer to batch 1 than to 64
    assert model.cost_ratio(32, 100) == pytest.approx(1.2)
    batch = [Candidate(f"r{i}", 100) for i in range(3)]      # bucket (4, 256): borrows 3.0
    for c in batch:
        model.observe_acceptance(c.req_id, 2.0)             # speedup 2 / 3
    assert all(d == Decision(False, REASON_COST) for d in model.decide(batch).values())


def test_disable_by_batch_size_thresholds():
    policy = SpeculationPolicy(K, 3)
    cands = [Candidate(f"r{i}", 10) for i in range(3)]
    plan = policy.plan(cands[:2], num_running=2)
    assert plan.propose and all(plan.drafts(c.req_id) for c in cands[:2])
    assert not plan.nobody_drafts
    plan = policy.plan(cands, num_running=3)  # >= N: nobody drafts
    assert not plan.propose and plan.nobody_drafts
    assert all(plan.decision(c.req_id) == Decision(False, REASON_BATCH) for c in cands)
    assert not any(plan.drafts(c.req_id) for c in cands)
    policy.count(plan, [c.req_id for c in cands])
    assert policy.stats()["num_skipped"] == {REASON_BATCH: 3}
    # N = 1: never drafts, not even a lone request.
    plan = SpeculationPolicy(K, 1).plan(cands[:1], num_running=1)
    assert not plan.propose and not plan.drafts("r0")
    # None: always drafts, no cost model.
    policy = SpeculationPolicy(K, None)
    assert policy.plan(cands, num_running=100).propose and policy.cost_model is None


def test_mixed_and_prefill_steps_are_not_timed():
    policy = auto_policy()
    out = object()
    plan = policy.plan([Candidate("a", 10), Candidate("b", 10)], num_running=2)
    policy.plan_timing(out, plan, {"a": K, "b": 0}, [10, 10], pure_decode=True)  # mixed
    policy.observe_step_time(out, 1.0)
    policy.plan_timing(out, plan, {"a": K, "b": K}, [10, 10], pure_decode=False)  # prefill
    policy.observe_step_time(out, 1.0)
    assert policy.cost_model.snapshot()["step_times"] == {}
    policy.plan_timing(out, plan, {"a": K, "b": K}, [10, 10], pure_decode=True)
    policy.observe_step_time(object(), 1.0)  # another step's output: ignored
    policy.plan_timing(out, plan, {"a": K, "b": K}, [10, 10], pure_decode=True)
    policy.observe_step_time(out, 1.0)
    assert policy.cost_model.snapshot()["step_times"] == {
        "b2_c256": {SPEC: {"seconds": 1.0, "samples": 1, "recent": [1.0]}}}


def test_injected_timer_and_acceptance():
    model = SpeculationCostModel(K, acceptance_override=1.0,
                                 step_time_fn=lambda kind, b, c: 3.0 if kind == SPEC else 1.0)
    for kind in (SPEC, PLAIN, SPEC, PLAIN):
        model.observe_step(kind, 1, 10, 123.0)  # the measured seconds are replaced
    assert model.step_time(SPEC, 1, 10) == pytest.approx(3.0)
    assert model.step_time(PLAIN, 1, 10) == pytest.approx(1.0)
    assert model.expected_speedup("anyone", 1, 10) == pytest.approx(1.0 / 3.0)


@pytest.mark.parametrize("value,expected", [(None, None), (4, 4), (1, 1), ("auto", "auto"),
                                            ("AUTO", "auto"), ("8", 8)])
def test_config_accepts(value, expected):
    spec = SpeculativeConfig(method="dspark", num_speculative_tokens=4,
                             disable_by_batch_size=value)
    assert spec.disable_by_batch_size == expected
    assert SpeculativeConfig.from_json({"method": "dspark", "disable_by_batch_size": value}) \
        .disable_by_batch_size == expected


@pytest.mark.parametrize("value", [0, -2, True, 2.5, "sometimes", ""])
def test_config_rejects_with_the_fix(value):
    with pytest.raises(ValueError) as info:
        SpeculativeConfig(method="dspark", disable_by_batch_size=value)
    message = str(info.value)
    assert f"disable_by_batch_size={value!r}" in message and "'auto'" in message
    assert "int N >= 1" in message


def test_cost_model_config_errors_name_the_value():
    with pytest.raises(ValueError, match="probe_len=8 must be smaller than probe_interval=8"):
        CostModelConfig(probe_interval=8, probe_len=8)
    with pytest.raises(ValueError, match=r"time_window=0 is invalid"):
        CostModelConfig(time_window=0)
    with pytest.raises(ValueError, match=r"acceptance_alpha=1\.5 is invalid"):
        CostModelConfig(acceptance_alpha=1.5)
    with pytest.raises(ValueError, match=r"probe_budget=0\.0 is invalid"):
        CostModelConfig(probe_budget=0.0)
    with pytest.raises(ValueError, match=r"stop_confidence=-1\.0 is invalid: it must be >= 0"):
        CostModelConfig(stop_confidence=-1.0)
    with pytest.raises(ValueError, match="step kind 'draft' is invalid"):
        SpeculationCostModel(K).observe_step("draft", 1, 1, 1.0)


def test_a_revival_resets_the_probe_interval():
    # Off from the start (acceptance 1); from step 100 on, "a"'s drafts match (4). Probes back
    # off while nobody revives; the probe that revives "a" resets the interval to 16 (judged
    # once "a" has its two fresh samples), then "b" alone backs it off again.
    acceptance = {"a": lambda step: 1.0 if step < 100 else 4.0, "b": 1.0}
    policy = auto_policy(probe_interval=16, max_probe_interval=1024, probe_budget=None)
    loop = Loop(policy, acceptance, t_spec=1.5)
    intervals = []
    for _ in range(300):
        loop.one_step()
        intervals.append(policy.cost_model.snapshot()["probe_interval"])
    assert max(intervals[:100]) >= 64
    revived = next(i for i in range(100, 300) if all(e["a"] for e in loop.log[i:]))
    assert 16 in intervals[revived:revived + 8]
    assert all(entry["a"] for entry in loop.log[revived:])


def test_uniform_plans_never_read_the_candidates():
    # disable_by_batch_size N (and no policy) decide once per step: building a candidate per
    # running request would be per-request host work in a step where nobody drafts.
    def exploding():
        raise AssertionError("a uniform policy iterated the candidates")
        yield  # pragma: no cover

    for n, running, drafts in ((3, 5, False), (3, 2, True), (None, 100, True)):
        policy = SpeculationPolicy(K, n)
        plan = policy.plan(exploding(), num_running=running)
        assert plan.propose == drafts and plan.drafts("any") == drafts
        assert plan.nobody_drafts == (not drafts)
        policy.count(plan, (), 7)
        stats = policy.stats()
        assert (stats["num_drafted"], stats["num_skipped"]) == \
            ((7, {}) if drafts else (0, {REASON_BATCH: 7}))


def test_plan_timing_counts_matches_plan_timing():
    # The scheduler's count-based call times the same steps as the per-request form.
    cases = [({"a": K, "b": K}, True, True), ({"a": 0, "b": 0}, False, True),
             ({"a": K, "b": 0}, True, True), ({"a": K, "b": K}, True, False)]
    for drafts, propose, pure in cases:
        plan = StepPlan({}, propose=propose)
        by_dict, by_counts = auto_policy(), auto_policy()
        out = object()
        by_dict.plan_timing(out, plan, drafts, [100, 300], pure_decode=pure)
        by_counts.plan_timing_counts(out, plan, len(drafts), sum(n > 0 for n in drafts.values()),
                                     200, pure_decode=pure)
        assert by_dict.pending_timings == by_counts.pending_timings


def test_slow_first_timings_do_not_hold_a_bucket():
    """The first steps of a kind in a bucket may pay one-time costs (a first plan, a graph's
    first launch). While a bucket holds <= 4 timings its time is their minimum, so one good
    sample corrects any number of slow ones before it (seen on the H200: two slow exploration
    plain steps)."""
    model = SpeculationCostModel(K, CostModelConfig(min_samples=2))
    model.observe_step("plain", 1, 64, 0.010)
    model.observe_step("plain", 1, 64, 0.009)
    assert model.step_time("plain", 1, 64) == pytest.approx(0.009)
    model.observe_step("plain", 1, 64, 0.0013)
    assert model.step_time("plain", 1, 64) == pytest.approx(0.0013)
    model.observe_step("spec", 1, 64, 0.0030)
    model.observe_step("spec", 1, 64, 0.0020)
    assert model.step_time("spec", 1, 64) == pytest.approx(0.0020)


def test_step_time_is_the_lower_quartile_of_the_last_window():
    window = 8
    model = SpeculationCostModel(K, CostModelConfig(time_window=window, min_samples=1))
    samples = [0.004, 0.009, 0.001, 0.007, 0.002, 0.030, 0.003, 0.005, 0.006, 0.0005, 0.008,
               0.004]
    for i, t in enumerate(samples):
        model.observe_step(PLAIN, 2, 100, t)
        last = samples[max(0, i + 1 - window):i + 1]
        # Brute force: the largest held timing with at most a quarter of the others below it
        # (index (n - 1) // 4 of the sorted window).
        below = [sum(u < v for u in last) for v in last]
        expect = max(v for v, b in zip(last, below) if b <= (len(last) - 1) // 4)
        assert model.step_time(PLAIN, 2, 100) == pytest.approx(expect), i
    # One freak-fast timing in a full window is ignored (0.0005 above is one of 8).
    assert model.step_time(PLAIN, 2, 100) > 0.0005


def test_snapshot_keeps_the_last_raw_timings_of_a_bucket():
    model = SpeculationCostModel(K)
    window = model.config.time_window
    samples = [0.5 + 0.1 * i for i in range(window + 3)]
    for t in samples:
        model.observe_step(PLAIN, 4, 300, t)
    entry = model.snapshot()["step_times"]["b4_c512"][PLAIN]
    assert entry["recent"] == samples[-window:]
    assert entry["samples"] == len(samples)


def test_acceptance_estimate_is_an_even_mean_then_an_ema_with_its_spread():
    """The arithmetic of the estimate, by hand: the first 1/alpha samples weigh alike (mean and
    population variance), later ones by alpha; stderr = sqrt(var / min(n, (2 - alpha) / alpha))."""
    import math
    model = SpeculationCostModel(K, CostModelConfig(acceptance_alpha=0.25,
                                                    min_acceptance_samples=1))
    for sample in (1.0, 3.0, 5.0, 3.0):
        model.observe_acceptance("r", sample)
    est = model._requests["r"].acceptance
    assert est.value == pytest.approx(3.0) and est.var == pytest.approx(2.0)  # 4 alike
    assert est.stderr(0.25) == pytest.approx(math.sqrt(2.0 / 4))
    model.observe_acceptance("r", 5.0)  # the 5th: weight 0.25
    assert est.value == pytest.approx(3.5)
    assert est.var == pytest.approx(0.75 * (2.0 + 0.25 * 4.0))
    assert est.stderr(0.25) == pytest.approx(math.sqrt(est.var / 5))  # 5 samples < (2 - a) / a = 7


def test_a_drafting_request_stops_only_when_even_its_optimistic_estimate_loses():
    # Cost ratio 2: a = 1.8 loses (0.9x). With a wide spread (samples 1 and 2.6), estimate plus
    # two standard errors still pays, so it keeps drafting; with stop_confidence 0 it stops.
    def model_after(samples, confidence):
        model = SpeculationCostModel(K, CostModelConfig(min_acceptance_samples=2,
                                                        stop_confidence=confidence))
        for _ in range(2):
            model.observe_step(SPEC, 1, 500, 2.0)
            model.observe_step(PLAIN, 1, 500, 1.0)
        for sample in samples:
            model.observe_acceptance("r", sample)
        return model.decide([Candidate("r", 500)])["r"]

    assert model_after([1.0, 2.6], 2.0).draft        # 1.8 + 2 * 0.8 / sqrt(2) = 2.93 pays
    assert not model_after([1.0, 2.6], 0.0).draft    # 1.8 / 2 = 0.9 < 0.95
    assert not model_after([1.8, 1.8], 2.0).draft    # no spread: 1.8 loses either way


@pytest.mark.parametrize("timed", [1.0, 0.25])
@pytest.mark.parametrize("seed", range(6))
def test_the_settled_shortcut_decides_what_the_full_loop_decides(seed, timed):
    """Once every request has stopped, decide() skips its per-request loop until a request
    comes, goes or verifies drafts, a probe starts, or the ratio could restart the best of
    them. Oracle: the same model with the shortcut off, fed the same random engine (requests
    arriving and finishing, acceptances drifting between 1 and 4.5 and reported a step late as
    the engine reports them, plain steps whose cost jumps between 1x and 2.2x so that the
    cost ratio can restart a stopped request, the acceptance override switched on and off):
    identical decisions at every step. `timed`: the share of steps whose time is observed (a
    settled engine times one step in settled_timing_interval, so the shortcut's values derived
    from the ratio are reused across untimed steps and re-derived after a timed one)."""
    import random
    rng = random.Random(seed)
    fast, full = (SpeculationCostModel(K, CostModelConfig(probe_interval=8, probe_budget=0.1))
                  for _ in range(2))
    full.settled_fast_path = False
    models = (fast, full)
    levels = {f"r{i}": rng.choice([1.0, 1.5, 3.5]) for i in range(4)}
    next_id, settled_steps, plain_cost, late = len(levels), 0, 1.0, {}
    for step in range(1500):
        if rng.random() < 0.03:
            plain_cost = rng.choice([1.0, 2.2])
        if rng.random() < 0.02:
            levels[f"r{next_id}"] = rng.choice([1.0, 1.5, 3.5])
            next_id += 1
        if rng.random() < 0.02 and len(levels) > 1:
            gone = rng.choice(sorted(levels))
            del levels[gone]
            for m in models:
                m.remove_request(gone)
        if rng.random() < 0.02:  # a request's drafts start (or stop) matching
            levels[rng.choice(sorted(levels))] = rng.choice([1.0, 1.5, 3.5, 4.5])
        if step in (300, 500):
            for m in models:
                m.acceptance_override = 1.0 if step == 300 else None
        candidates = [Candidate(r, 200 + 3 * step) for r in levels]
        settled_steps += fast._settled is not None
        got, want = fast.decide(candidates), full.decide(candidates)
        assert got == want, (seed, step)
        drafting = [r for r, d in got.items() if d.draft]
        kind = SPEC if len(drafting) == len(got) else PLAIN if not drafting else None
        seconds = (2.5 if kind == SPEC else plain_cost) * (1.0 + 0.2 * rng.random())
        observed = kind is not None and rng.random() < timed
        for m in models:
            if observed:
                m.observe_step(kind, len(got), 200 + 3 * step, seconds)
            for r, a in late.items():  # the previous step's verified drafts
                if r in levels:
                    m.observe_acceptance(r, a)
        late = {r: min(K + 1, max(1, round(rng.gauss(levels[r], 0.8)))) for r in drafting}
    assert settled_steps >= 50, settled_steps  # the shortcut was taken, and agreed


@pytest.mark.parametrize("seed", range(4))
def test_cached_ratios_equal_a_scan_of_every_timing(seed):
    """cost_ratio keeps the ratios it borrowed and observe_step its last bucket from step to
    step. Oracle: every observation kept in a list; a bucket's time is the lower quartile of its
    last time_window timings, trusted from min_samples on; a bucket's ratio is its own, else the
    nearest bucket's with both (distance in powers of two, ties to the smaller bucket). Random
    timings over batch sizes and growing contexts, each followed by repeated queries (the
    second of which reads the caches)."""
    import random
    rng = random.Random(seed)
    cfg = CostModelConfig(min_samples=2, time_window=8)
    model = SpeculationCostModel(K, cfg)
    seen: dict[tuple[str, tuple[int, int]], list[float]] = {}

    def bucket(batch, context):
        return pow2_bucket(batch), pow2_bucket(max(context, cfg.min_context_bucket))

    def oracle(batch, context):
        value = {}
        for key, xs in seen.items():
            if len(xs) >= cfg.min_samples:
                last = sorted(xs[-cfg.time_window:])
                value[key] = last[(len(last) - 1) // 4]
        pairs = {b: value[(SPEC, b)] / value[(PLAIN, b)]
                 for kind, b in value if kind == SPEC and (PLAIN, b) in value}
        if not pairs:
            return None
        want = bucket(batch, context)
        if want in pairs:
            return pairs[want]

        def distance(b):
            return (abs(b[0].bit_length() - want[0].bit_length())
                    + abs(b[1].bit_length() - want[1].bit_length()), b)
        return pairs[min(pairs, key=distance)]

    queries = [(1, 100), (2, 300), (8, 600), (8, 5000), (16, 100), (64, 2000)]
    for step in range(800):
        kind = rng.choice([SPEC, PLAIN, PLAIN])
        batch = rng.choice([1, 2, 3, 8, 8, 8, 16])
        context = rng.choice([50, 300, 300, 700, 2000]) + step // 2
        seconds = rng.uniform(0.5, 3.0)
        model.observe_step(kind, batch, context, seconds)
        seen.setdefault((kind, bucket(batch, context)), []).append(seconds)
        for b, c in rng.sample(queries, 3):
            want = oracle(b, c)
            for _ in range(2):
                got = model.cost_ratio(b, c)
                assert (got is None and want is None) or got == pytest.approx(want), \
                    (seed, step, b, c, got, want)


def test_a_settled_batch_is_judged_again_when_its_context_bucket_changes():
    """The settled shortcut holds within one context bucket: a request that stopped where
    drafting costs 3 plain steps restarts as soon as its context enters the bucket where it
    costs 1.2 (acceptance 2: speedup 2/3, then 2/1.2)."""
    model = SpeculationCostModel(K, CostModelConfig(min_samples=2), acceptance_override=2.0)
    for _ in range(2):
        model.observe_step(SPEC, 1, 100, 3.0)     # bucket (1, 256): ratio 3
        model.observe_step(PLAIN, 1, 100, 1.0)
        model.observe_step(SPEC, 1, 300, 1.2)     # bucket (1, 512): ratio 1.2
        model.observe_step(PLAIN, 1, 300, 1.0)
    for _ in range(3):
        assert model.decide([Candidate("r", 100)])["r"] == Decision(False, REASON_COST)
    assert model._settled is not None  # the next steps in this bucket take the shortcut
    assert model.decide([Candidate("r", 256)])["r"] == Decision(False, REASON_COST)
    assert model.decide([Candidate("r", 257)])["r"].draft


@pytest.mark.parametrize("interval", [1, 4, 8])
def test_a_settled_engine_times_one_step_in_the_interval(interval):
    """Where drafting cannot pay the engine sits in the settled shortcut; recording and
    observing a step time costs the host every step, so only one settled step in
    `settled_timing_interval` is timed. Every step that is not settled, and every step while
    a probe's cost is being audited, is still timed (the probe credit is charged what all of a
    probe's steps measured). Oracle: the engine protocol played through the policy (Loop),
    counting the step times the cost model receives."""
    policy = auto_policy(settled_timing_interval=interval, probe_interval=40,
                         max_probe_interval=40, probe_budget=0.5)
    model = policy.cost_model
    timed_steps = []
    observe = model.observe_probe_step  # called for every timed step (policy.observe_step_time)
    model.observe_probe_step = lambda step, s: (timed_steps.append(step), observe(step, s))[1]
    loop = Loop(policy, {"a": 1.0, "b": 1.0}, t_spec=3.0)
    settled, audited = [], []
    for _ in range(600):
        audit_open = model._probe_audit is not None
        before = len(timed_steps)
        loop.one_step()
        timed = len(timed_steps) > before
        if model.last_settled:
            settled.append(timed)
        else:
            assert timed, loop.step - 1  # a step decided by the full loop is always timed
        if audit_open:
            audited.append(loop.step - 1)
            assert timed, loop.step - 1
    assert len(settled) >= 300, len(settled)  # the shortcut was taken
    # One timed settled step in `interval`; every probe breaks the run of settled steps and
    # restarts nothing (the count carries on), so the count is exact up to one per run.
    assert len(settled) // interval - 1 <= sum(settled) <= len(settled) // interval + 1, (
        sum(settled), len(settled))
    assert audited and model.probe_costs, "no probe was audited: the test reached no probe"


def test_wants_step_timed_counts_settled_steps_only():
    model = SpeculationCostModel(K, CostModelConfig(min_samples=2, settled_timing_interval=3,
                                                    probe_interval=10 ** 6,
                                                    max_probe_interval=10 ** 6),
                                 acceptance_override=1.0)
    for _ in range(2):
        model.observe_step(SPEC, 1, 100, 3.0)
        model.observe_step(PLAIN, 1, 100, 1.0)
    got = []
    for _ in range(10):
        assert model.decide([Candidate("r", 100)])["r"] == Decision(False, REASON_COST)
        got.append((model.last_settled, model.wants_step_timed()))
    # the first step judges everyone (full loop, timed); then one settled step in three
    assert got == [(False, True)] + [(True, False), (True, False), (True, True)] * 3
    # While a probe's cost is audited (the audit's window is open), every step is timed.
    model._probe_audit = [model.last_step, model.last_step + 100, 1.0, 0.0, 0.0, 0]
    for _ in range(5):
        model.decide([Candidate("r", 100)])
        assert model.last_settled and model.wants_step_timed()
