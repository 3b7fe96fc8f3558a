"""Wall time and FlashInfer plan counts of an engine's steps, by kind of step (the speculation
policy's probe steps against its plain and verify steps). Used by scripts/probe_spec_step.py and
the GPU test of probe-step cost (tests/v1/e2e/test_spec_policy_gpu.py).

Kinds, from the step's SchedulerOutput: "verify" (drafts verified), "propose-only" (nobody
verifies drafts and the draft pass runs after: the first step of a policy probe), "plain after
verify" (the first no-draft step after a verify step) and "plain" (no drafts, no draft pass).
"""
from __future__ import annotations

import statistics
from collections import defaultdict

from vllm.benchmarks.datasets import spec_bench_prompt


def set_probe_interval(cost_model, interval: int) -> None:
    """--probe-interval: the "auto" policy re-probes every `interval` steps (never backing off,
    no cost-based spacing), so that a short run times many probe steps."""
    from dataclasses import replace
    cost_model.config = replace(cost_model.config, probe_interval=interval,
                                max_probe_interval=interval, probe_budget=None)
    cost_model._probe_interval = interval
    cost_model._next_probe = min(cost_model._next_probe, cost_model._step + interval)


def flashinfer_plan_counts_by_group(runner) -> list[tuple[int, int, int]]:
    """Per KV cache group (the runner's builder order): (full FlashInfer plans, native
    re-plans, plan refreshes) made so far by that builder's wrapper slots (zeros for backends
    without FlashInfer wrappers). A full plan is FlashInfer's Python plan(): ~1 ms of host time
    plus pinned allocations; a native re-plan ~0.2 ms; a refresh (flashinfer_plan_refresh.py)
    rewrites three work arrays."""
    counts = []
    for builder in runner.attn_metadata_builders:
        slots = _wrapper_slots(builder)
        counts.append((sum(getattr(s, "full_plans", 0) for s in slots),
                       sum(getattr(s, "native_replans", 0) for s in slots),
                       sum(getattr(s, "refreshes", 0) for s in slots)))
    return counts


def plan_cache_put_backs(runner) -> list[int]:
    """Per KV cache group (the runner's builder order): kept plans put back so far by that
    builder's graph wrappers (flashinfer_plan_cache.py) in place of a re-plan."""
    return [sum(getattr(getattr(s, "refresher", None), "cache_put_backs", 0)
                for s in _wrapper_slots(builder)) for builder in runner.attn_metadata_builders]


def host_written_plans(runner) -> list[int]:
    """Per KV cache group: plans written on the host so far for chunk structures the plan
    cache lacked (flashinfer_host_plan.py), each in place of a native re-plan."""
    return [sum(getattr(getattr(s, "refresher", None), "host_plans", 0)
                for s in _wrapper_slots(builder)) for builder in runner.attn_metadata_builders]


def _wrapper_slots(builder) -> list:
    """A builder's FlashInfer wrapper slots, eager and graph (none for other backends)."""
    return (list(getattr(builder, "_slots", {}).values())
            + list(getattr(builder, "_graph_slots", {}).values()))


def flashinfer_plan_counts(runner) -> tuple[int, int]:
    """(full FlashInfer plans, native re-plans) made so far over every group's builder."""
    by_group = flashinfer_plan_counts_by_group(runner)
    return sum(c[0] for c in by_group), sum(c[1] for c in by_group)


class StepKinds:
    """Records each step's kind, wall time, FlashInfer plan counts and phase times. Wraps the
    engine's scheduler.schedule (on the instance) to see the step's SchedulerOutput; call
    before() / after(ms, phases) around every timed engine.step(), restore() at the end."""

    def __init__(self, engine, split_replans: bool = False):
        self.engine = engine
        # split_replans: a step that made a FlashInfer plan (full or native re-plan) is its
        # own kind ("verify, re-planned"), so the table shows what such steps cost apart
        self.split_replans = split_replans
        self.runner = engine.executor.worker.model_runner
        self.sched = engine.scheduler
        self.last = None

        def schedule():
            # Looked up on the class at each call: the phase timers wrap it there.
            self.last = type(self.sched).schedule(self.sched)
            return self.last
        self.sched.schedule = schedule
        self.rows: dict[str, list[tuple[float, int, int, dict]]] = defaultdict(list)
        # per kind: per step, per group (full, native, refresh) deltas
        self.group_rows: dict[str, list[list[tuple[int, int, int]]]] = defaultdict(list)
        self._previous = "plain"

    def before(self) -> None:
        self.last = None
        self.last_kind = None  # the kind after() gave the step (None: not recorded)
        self._by_group = flashinfer_plan_counts_by_group(self.runner)
        self._counts = (sum(c[0] for c in self._by_group), sum(c[1] for c in self._by_group))

    def after(self, ms: float, phases: dict) -> None:
        so = self.last
        if so is None:
            return
        if so.scheduled_spec_decode_tokens:
            kind = "verify"
        elif self.runner.speculator is not None and so.propose_drafts:
            kind = "propose-only"
        elif self._previous == "verify":
            kind = "plain after verify"
        else:
            kind = "plain"
        self._previous = kind
        by_group = flashinfer_plan_counts_by_group(self.runner)
        full, native = sum(c[0] for c in by_group), sum(c[1] for c in by_group)
        if self.split_replans and (full, native) != self._counts:
            kind += ", re-planned"
        self.last_kind = kind
        self.rows[kind].append((ms, full - self._counts[0], native - self._counts[1], phases))
        self.group_rows[kind].append([tuple(a - b for a, b in zip(now, then))
                                      for now, then in zip(by_group, self._by_group)])

    def restore(self) -> None:
        self.sched.__dict__.pop("schedule", None)

    def summary(self) -> dict:
        out = {}
        for kind, rows in self.rows.items():
            ms = [r[0] for r in rows]
            labels = sorted({k for r in rows for k in r[3]})
            out[kind] = {
                "steps": len(rows), "median_ms": statistics.median(ms),
                "mean_ms": statistics.fmean(ms), "max_ms": max(ms),
                "full_plans_per_step": sum(r[1] for r in rows) / len(rows),
                "native_replans_per_step": sum(r[2] for r in rows) / len(rows),
                # [group] -> {"full", "native", "refresh"} per step
                "plans_per_step_by_group": [
                    dict(zip(("full", "native", "refresh"),
                             (sum(step[g][i] for step in self.group_rows[kind]) / len(rows)
                              for i in range(3))))
                    for g in range(len(self.group_rows[kind][0]) if self.group_rows[kind]
                                   else 0)],
                "phases_mean_ms": {label: statistics.fmean(r[3].get(label, 0.0) for r in rows)
                                   * 1e3 for label in labels},
            }
        return out


def measure_step_kinds(disable_by_batch_size, batch: int, *, steps: int = 120,
                       warmup: int = 24, probe_interval: int = 8,
                       forced_acceptance: float | None = 1.0, num_spec_tokens: int = 4,
                       context: int = 64, device: str = "cuda", dtype: str = "bfloat16",
                       attention_backend: str = "FLASHINFER_MLA", enforce_eager: bool = False,
                       method: str = "dspark") -> dict:
    """Greedy decode of `batch` requests on the built-in tiny model with a speculative engine;
    the per-kind summary (StepKinds.summary) of `steps` steps after `warmup`. With "auto", the
    cost model's acceptance is forced to `forced_acceptance` (1.0: drafting cannot pay) and it
    re-probes every `probe_interval` steps, so the timed steps hold many probes."""
    import time

    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    spec = {"method": method, "num_speculative_tokens": num_spec_tokens,
            "disable_by_batch_size": disable_by_batch_size}
    extra = {} if device == "cuda" else {"device": device}
    total = (steps + warmup) * (num_spec_tokens + 1) + 8
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=None, dtype=dtype, max_model_len=context + total + 64,
        attention_backend=attention_backend, speculative_config=spec, max_num_seqs=batch,
        max_num_batched_tokens=max(4096, batch * (context + 1)), enforce_eager=enforce_eager,
        seed=0, async_scheduling=False, **extra))
    try:
        model = engine.scheduler.spec_policy.cost_model
        if model is not None:
            model.acceptance_override = forced_acceptance
        params = SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"r{i}", spec_bench_prompt(i, context), params)
        for _ in range(warmup):
            engine.step()
        if model is not None and probe_interval:
            set_probe_interval(model, probe_interval)
        kinds = StepKinds(engine)
        try:
            for _ in range(steps):
                kinds.before()
                start = time.perf_counter()
                engine.step()
                kinds.after((time.perf_counter() - start) * 1e3, {})
        finally:
            kinds.restore()
        return kinds.summary()
    finally:
        engine.shutdown()
