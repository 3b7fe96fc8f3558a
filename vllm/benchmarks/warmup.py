"""Warm-up that lets an engine's own measured choices settle before a benchmark times it.

Why: with `VLLM_EARLY_DRAFT_METADATA=auto` (the default) a block drafter's engine times its
first eligible steps of each batch-size bucket twice, first with the early draft path off, then
on, and only then keeps the faster (EarlyDraftTuner: 2 x 9 steps where the paths differ
clearly, up to 68 where they do not). A benchmark whose timed
steps fall inside that trial measures the trial, not the engine: the engine decode benchmark's
5 warm-up + 40 timed steps were mostly the trial's late window (twenty-fourth session).
"""
from __future__ import annotations

from typing import Any, Callable


def early_draft_tuner(engine: Any) -> Any:
    """The in-process engine's EarlyDraftTuner, or None (no block drafter, mode not "auto",
    not decided yet whether the early path applies, or a worker in another process)."""
    worker = getattr(getattr(engine, "executor", None), "worker", None)
    speculator = getattr(getattr(worker, "model_runner", None), "speculator", None)
    return getattr(speculator, "early_tuner", None)


def settle_early_draft(engine: Any, step: Callable[[], None], max_steps: int) -> tuple[int, str]:
    """Step `engine` (through `step`) until its early draft tuner has decided for the running
    batch's bucket, at most `max_steps` steps. Returns (steps taken, decision): decision is
    "early" or "late", "trial" if `max_steps` ran out first (the caller reports it), or "-" where
    the engine has no tuner."""
    taken = 0
    while taken < max_steps and engine.has_unfinished_requests():
        tuner = early_draft_tuner(engine)
        if tuner is None and taken:
            break  # made at the first draft step with graphs: one step shows whether there is one
        if tuner is not None and tuner.settled(engine.get_num_unfinished_requests()):
            break
        step()
        taken += 1
    tuner = early_draft_tuner(engine)
    return taken, "-" if tuner is None else tuner.decision(engine.get_num_unfinished_requests())
