"""The scheduler's speculation policy: which decoding requests draft this step.

`speculative_config.disable_by_batch_size`:
* None   -> every request drafts every step (no policy);
* N      -> upstream's rule: nobody drafts while N or more requests run;
* "auto" -> the cost model (cost_model.py) decides per request from measured step times and the
            request's running acceptance length.

A request that does not draft is scheduled as a plain decode (its drafts, if any, are dropped), so
greedy output is the same whatever the policy decides. The decision for step t also says whether
the drafter must run after step t (`propose`): drafts proposed at step t are verified at t + 1.
Counters feed `/metrics` (vllm:spec_decode_policy_*) and the engine's stats.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from vllm.v1.spec_decode.cost_model import (PLAIN, REASON_BATCH, SHARED_DECISIONS, SPEC,
                                            Candidate, Decision, SpeculationCostModel)

MODE_ALWAYS = "always"
MODE_BATCH = "batch_size"
MODE_AUTO = "auto"


# Timing records kept for steps in flight (async scheduling keeps at most two in flight).
MAX_PENDING_TIMINGS = 4


@dataclass
class StepPlan:
    """This step's decisions as the scheduler applies them.

    `decisions` holds per-request decisions ("auto"); a uniform plan (disable_by_batch_size N,
    or no policy) leaves it empty and gives every request `default` instead, so a step costs
    the scheduler O(1) whatever the batch size. A request with no decision drafts."""

    decisions: dict[str, Decision]
    propose: bool  # must the drafter run after this step?
    default: Decision | None = None
    # True when no request drafts this step: a uniform plan that says so, or per-request
    # decisions ("auto") that are all off. Such a step schedules plain decodes only. A field,
    # not a property: the scheduler's steady path reads it at every step, and plans are never
    # modified after they are made.
    lets_nobody_draft: bool = field(init=False)

    def __post_init__(self):
        if self.decisions:
            self.lets_nobody_draft = not any(d.draft for d in self.decisions.values())
        else:
            self.lets_nobody_draft = self.default is not None and not self.default.draft

    def decision(self, req_id: str) -> Decision | None:
        return self.decisions.get(req_id, self.default)

    def drafts(self, req_id: str) -> bool:
        decision = self.decision(req_id)
        return decision is None or decision.draft

    @property
    def nobody_drafts(self) -> bool:
        """True for a uniform plan that lets nobody draft (the scheduler drops every draft)."""
        return not self.decisions and self.default is not None and not self.default.draft


_NO_POLICY_PLAN = StepPlan({}, propose=True)
_BATCH_OFF = Decision(False, REASON_BATCH)
_BATCH_ON = Decision(True)
# disable_by_batch_size N has two plans, made once (plans are never modified).
_BATCH_OFF_PLAN = StepPlan({}, propose=False, default=_BATCH_OFF)
_BATCH_ON_PLAN = StepPlan({}, propose=True, default=_BATCH_ON)
# "auto"'s uniform plans, one per shared decision of the cost model (a step allocates no plan).
_AUTO_PLANS = tuple((d, StepPlan({}, propose=d.draft, default=d)) for d in SHARED_DECISIONS)


def _uniform_plan(decision: Decision) -> StepPlan:
    """The plan that gives everyone `decision` (by identity: a Decision hashes its fields)."""
    for shared, plan in _AUTO_PLANS:
        if decision is shared:
            return plan
    return StepPlan({}, propose=decision.draft, default=decision)


class SpeculationPolicy:

    def __init__(self, num_spec_tokens: int, disable_by_batch_size: int | str | None = None,
                 cost_model: SpeculationCostModel | None = None):
        self.num_spec_tokens = int(num_spec_tokens)
        self.disable_by_batch_size = disable_by_batch_size
        if disable_by_batch_size is None:
            self.mode = MODE_ALWAYS
        elif disable_by_batch_size == "auto":
            self.mode = MODE_AUTO
        elif isinstance(disable_by_batch_size, int) and not isinstance(disable_by_batch_size, bool) \
                and disable_by_batch_size >= 1:
            self.mode = MODE_BATCH
        else:
            raise ValueError(f"disable_by_batch_size={disable_by_batch_size!r} is invalid: use an "
                             "int N >= 1, 'auto' or None.")
        # False without a policy (disable_by_batch_size None): everyone drafts every step. (An
        # attribute: the scheduler's steady path reads it at every step; the mode is fixed.)
        self.active = self.mode != MODE_ALWAYS
        self.cost_model = None
        if self.mode == MODE_AUTO:
            self.cost_model = cost_model or SpeculationCostModel(self.num_spec_tokens)
        self.num_drafted = 0
        self.num_skipped: Counter[str] = Counter()
        # Steps planned but not timed yet: id(output) -> (kind, batch, ctx). One entry in a
        # synchronous engine; with async scheduling, one per step in flight (a record whose step
        # never reports, e.g. a failed one, is dropped by age).
        self.pending_timings: dict[int, tuple[str, int, int]] = {}

    @classmethod
    def from_config(cls, spec_config) -> SpeculationPolicy:
        return cls(int(spec_config.num_speculative_tokens),
                   getattr(spec_config, "disable_by_batch_size", None))

    # ---- per step ----------------------------------------------------------------------------
    def plan(self, decoding: Iterable[Candidate], num_running: int) -> StepPlan:
        """Decisions for the requests that decode this step; `num_running` is the size of the
        running batch (upstream's disable_by_batch_size compares it with N). Only "auto" reads
        `decoding` (pass a generator: the other modes never build a candidate)."""
        if self.mode != MODE_AUTO:
            return self.plan_ids((), (), num_running)
        decoding = list(decoding)
        return self.plan_ids([c.req_id for c in decoding], [c.context_len for c in decoding],
                             num_running)

    def plan_ids(self, req_ids: list[str], contexts: list[int], num_running: int) -> StepPlan:
        """plan() on the decoding requests' ids and planned token counts in two lists (only
        "auto" reads them)."""
        return self.plan_ids_total(req_ids, sum(contexts), num_running)

    def plan_ids_total(self, req_ids: list[str], total_context: int,
                       num_running: int) -> StepPlan:
        """plan_ids on the summed planned token counts (all the cost model reads of them; the
        scheduler's steady path sums as it goes)."""
        if self.mode == MODE_ALWAYS:
            return _NO_POLICY_PLAN
        if self.mode == MODE_BATCH:
            return (_BATCH_OFF_PLAN if num_running >= self.disable_by_batch_size
                    else _BATCH_ON_PLAN)
        ids, uniform, decisions = self.cost_model.decide_step_total(req_ids, total_context)
        if not ids:
            # No decoding request yet (only prefills): draft, as the user configured, and measure.
            return _NO_POLICY_PLAN
        if uniform is not None:
            return _uniform_plan(uniform)
        values = iter(decisions.values())
        first = next(values)
        if all(d is first for d in values):
            # One decision for the whole batch (the common case: everyone off, everyone
            # drafting, an exploration step): a uniform plan, so the scheduler applies and
            # counts it in O(1) (the cost model shares one frozen Decision per kind).
            return _uniform_plan(first)
        return StepPlan(decisions, propose=any(d.draft for d in decisions.values()))

    def count(self, plan: StepPlan, scheduled_decodes: Iterable[str],
              num_scheduled_decodes: int | None = None) -> None:
        """Count the decisions of the decode rows that were actually scheduled (a uniform plan
        counts `num_scheduled_decodes`, or the ids, without a per-request look-up)."""
        if not plan.decisions:
            n = (num_scheduled_decodes if num_scheduled_decodes is not None
                 else sum(1 for _ in scheduled_decodes))
            decision = plan.default
            if decision is None or decision.draft:
                self.num_drafted += n
            elif n:
                self.num_skipped[decision.reason or "unknown"] += n
            return
        for req_id in scheduled_decodes:
            decision = plan.decisions.get(req_id)
            if decision is None or decision.draft:
                self.num_drafted += 1
            else:
                self.num_skipped[decision.reason or "unknown"] += 1

    def account_steady(self, output, plan: StepPlan, req_ids: list[str],
                       total_context: int) -> None:
        """count() and plan_timing_counts() of a steady step, in one call: every decode of
        `plan` scheduled (`req_ids`, one token each, none with drafts), no prefill;
        `total_context`: their summed planned token counts. The scheduler's steady path makes
        it at every step of an engine whose policy lets nobody draft, so it is the policy's
        per-step overhead against no speculation there."""
        n = len(req_ids)
        if plan.decisions:
            self.count(plan, req_ids)
        elif n:
            decision = plan.default
            if decision is None or decision.draft:
                self.num_drafted += n
            else:
                self.num_skipped[decision.reason or "unknown"] += n
        if self.cost_model is not None and n:
            self.plan_timing_counts(output, plan, n, 0, total_context // n, pure_decode=True)

    def plan_timing(self, output, plan: StepPlan, decode_drafts: dict[str, int],
                    contexts: list[int], pure_decode: bool) -> None:
        """Remember what the step about to run measures: a SPEC step (every row verifies drafts
        and the drafter runs after) or a PLAIN one (no drafts, no draft pass); steps with
        prefills are not recorded, and a pure-decode mix of both gives no step time (it is
        recorded for the probe cost only, observe_probe_step)."""
        self.pending_timings.pop(id(output), None)
        if self.cost_model is None or not decode_drafts:
            return
        self.plan_timing_counts(output, plan, len(decode_drafts),
                                sum(1 for n in decode_drafts.values() if n > 0),
                                sum(contexts) // len(contexts), pure_decode)

    def plan_timing_counts(self, output, plan: StepPlan, num_decodes: int,
                           num_with_drafts: int, mean_context: int, pure_decode: bool) -> None:
        """plan_timing from counts the scheduler already has (no per-request dict)."""
        self.pending_timings.pop(id(output), None)  # (an id may be reused by a later output)
        if self.cost_model is None or not pure_decode or num_decodes == 0:
            return
        if not self.cost_model.wants_step_timed():
            return  # a settled step left untimed (CostModelConfig.settled_timing_interval)
        if plan.propose and num_with_drafts == num_decodes:
            kind = SPEC
        elif not plan.propose and num_with_drafts == 0:
            kind = PLAIN
        else:
            kind = None  # not a step time of either kind; a probe's cost still counts it
        timed = self.pending_timings
        timed[id(output)] = (kind, num_decodes, mean_context, self.cost_model.last_step)
        while len(timed) > MAX_PENDING_TIMINGS:
            del timed[next(iter(timed))]

    def observe_step_time(self, output, seconds: float) -> None:
        """The engine's host wall time of the step that ran `output`."""
        timed = self.pending_timings.pop(id(output), None)
        if timed is None:
            return
        kind, batch, context, step = timed
        if kind is not None:
            self.cost_model.observe_step(kind, batch, context, seconds)
        self.cost_model.observe_probe_step(step, seconds)

    def observe_acceptance(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        if self.cost_model is not None and num_drafts > 0:
            self.cost_model.observe_acceptance(req_id, 1 + num_accepted)

    def remove_request(self, req_id: str) -> None:
        if self.cost_model is not None:
            self.cost_model.remove_request(req_id)

    # ---- stats -------------------------------------------------------------------------------
    def stats(self) -> dict:
        out = {"mode": self.mode, "num_drafted": self.num_drafted,
               "num_skipped": dict(self.num_skipped)}
        if self.cost_model is not None:
            out["cost_model"] = self.cost_model.snapshot()
        return out
