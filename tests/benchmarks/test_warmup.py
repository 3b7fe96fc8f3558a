"""vllm/benchmarks/warmup.py: a benchmark's warm-up runs until the engine's early draft tuner
(EarlyDraftTuner, the real one) has decided for the running batch, so that timed steps measure
the decided path and not the trial."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm.benchmarks.warmup import early_draft_tuner, settle_early_draft
from vllm.v1.worker.gpu.spec_decode.early_draft import EarlyDraftTuner


class FakeEngine:
    """An engine whose every step is an eligible draft step of `num_reqs` rows: it asks the
    tuner which path to run and reports the step's host time as a speculator does. The tuner
    appears at the first step (the speculator makes it at its first draft step with graphs)."""

    def __init__(self, num_reqs: int, late_s: float, early_s: float, make_tuner: bool = True,
                 remaining_steps: int = 10_000, tuner_kwargs: dict | None = None):
        self.num_reqs, self.late_s, self.early_s = num_reqs, late_s, early_s
        self.make_tuner, self.remaining = make_tuner, remaining_steps
        self.tuner_kwargs = {"trial_steps": 5} if tuner_kwargs is None else tuner_kwargs
        self.speculator = SimpleNamespace(early_tuner=None)
        self.executor = SimpleNamespace(
            worker=SimpleNamespace(model_runner=SimpleNamespace(speculator=self.speculator)))
        self.paths: list[bool] = []

    def has_unfinished_requests(self) -> bool:
        return self.remaining > 0

    def get_num_unfinished_requests(self) -> int:
        return self.num_reqs

    def step(self) -> None:
        assert self.remaining > 0, "stepped an engine with nothing left to run"
        self.remaining -= 1
        if self.speculator.early_tuner is None:
            if not self.make_tuner:
                return
            self.speculator.early_tuner = EarlyDraftTuner(**self.tuner_kwargs)
        tuner = self.speculator.early_tuner
        early = tuner.use_early(self.num_reqs)
        self.paths.append(early)
        tuner.observe(self.num_reqs, early, self.early_s if early else self.late_s)


@pytest.mark.parametrize("late_s, early_s, decision", [(2.0, 1.0, "early"), (1.0, 2.0, "late")])
def test_warm_up_ends_exactly_when_the_tuner_decides(late_s, early_s, decision):
    engine = FakeEngine(num_reqs=3, late_s=late_s, early_s=early_s)
    taken, got = settle_early_draft(engine, engine.step, max_steps=100)
    tuner = early_draft_tuner(engine)
    assert got == decision
    assert taken == tuner.steps_to_decide == 12  # 2 windows of 5 timed + 1 switch step each
    # the trial ran both paths, the late window first; the next step runs the decided path
    assert engine.paths == [False] * 6 + [True] * 6
    engine.step()
    assert engine.paths[-1] == (decision == "early")
    # settled: another warm-up takes no step
    assert settle_early_draft(engine, engine.step, max_steps=100) == (0, decision)


def test_the_default_tuner_settles_a_clear_difference_within_a_benchmark_warm_up():
    """The engine's own tuner (defaults) keeps a clearly faster path after its quick windows:
    18 steps, inside benchmark_spec_policy's 32 warm-up steps, so none of its timed steps runs
    the trial's slower path."""
    engine = FakeEngine(num_reqs=1, late_s=1.08e-3, early_s=0.645e-3, tuner_kwargs={})
    taken, got = settle_early_draft(engine, engine.step, max_steps=100)
    assert (taken, got) == (18, "early") and taken < 32
    assert engine.paths == [False] * 9 + [True] * 9


def test_a_warm_up_cut_short_reports_the_trial():
    engine = FakeEngine(num_reqs=8, late_s=2.0, early_s=1.0)
    assert settle_early_draft(engine, engine.step, max_steps=7) == (7, "trial")


def test_each_batch_bucket_has_its_own_trial():
    engine = FakeEngine(num_reqs=1, late_s=2.0, early_s=1.0)
    assert settle_early_draft(engine, engine.step, max_steps=100)[1] == "early"
    engine.num_reqs = 8  # another power-of-two bucket: not decided yet
    taken, got = settle_early_draft(engine, engine.step, max_steps=100)
    assert (taken, got) == (12, "early")


def test_an_engine_without_a_tuner_takes_one_step_to_find_out():
    engine = FakeEngine(num_reqs=2, late_s=1.0, early_s=1.0, make_tuner=False)
    assert settle_early_draft(engine, engine.step, max_steps=100) == (1, "-")


def test_the_warm_up_stops_when_the_requests_run_out():
    engine = FakeEngine(num_reqs=2, late_s=2.0, early_s=1.0, remaining_steps=4)
    assert settle_early_draft(engine, engine.step, max_steps=100) == (4, "trial")
