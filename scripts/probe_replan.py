"""Where a FlashInfer MLA re-plan step's host time goes (tiny model, CUDA graphs).

A decode step whose plan cannot be refreshed (a request's KV chunk count changed) re-plans
natively; on the H200 such steps took 1-4 ms more than their neighbours (twelfth session,
scripts/trace_policy_steps.py). This wraps the plan path's functions with host timers and
prints, per function, calls and median / max host time, split by steps that re-planned or not.

`--own-copy both` runs the engine twice in one process, with FlashInfer's staging and with
VLLM_MLA_NATIVE_PLAN_OWN_COPY=1 (the planner's workspace bytes copied without a new pinned
buffer; then the JIT planner's own time is listed as "raw planner"), for a side-by-side A/B.

Usage (GPU): python scripts/probe_replan.py [--batch 8] [--steps 380] [--variant never]
                 [--sync] [--own-copy 0|1|both]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=380)
    parser.add_argument("--variant", default="never")
    parser.add_argument("--sync", action="store_true", help="synchronous scheduling")
    parser.add_argument("--own-copy", choices=("0", "1", "both"), default="0",
                        help="VLLM_MLA_NATIVE_PLAN_OWN_COPY for the run (both: one run each)")
    args = parser.parse_args()
    import os
    for value in (("0", "1") if args.own_copy == "both" else (args.own_copy,)):
        os.environ["VLLM_MLA_NATIVE_PLAN_OWN_COPY"] = value
        print(f"#### VLLM_MLA_NATIVE_PLAN_OWN_COPY={value}")
        probe(args)


_WRAPPED = False


def probe(args) -> None:
    import torch

    import vllm.v1.attention.backends.mla.flashinfer_mla as fm
    import vllm.v1.attention.backends.mla.flashinfer_plan_refresh as fr
    from vllm.benchmarks.spec_policy import SpecPolicyCase, build_engine
    from vllm.benchmarks.spec_step_kinds import flashinfer_plan_counts

    global _WRAPPED
    calls = _CALLS  # (name, us) of the current step

    def timed(owner, name, label=None):
        fn = getattr(owner, name)
        label = label or name

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                calls.append((label, (time.perf_counter() - t0) * 1e6))
        setattr(owner, name, wrapper)

    if not _WRAPPED:  # module-level functions: wrapped once per process
        _WRAPPED = True
        stage = fm._plan_and_stage

        def plan_and_stage(raw_plan, plan_args):
            def raw(*a):
                t0 = time.perf_counter()
                try:
                    return raw_plan(*a)
                finally:
                    calls.append(("raw planner", (time.perf_counter() - t0) * 1e6))
            return stage(raw, plan_args)
        fm._plan_and_stage = plan_and_stage
        for name in ("_plan", "_native_replan", "_adopt_plan", "_upload_csr", "_refresh",
                     "_plan_and_stage"):
            timed(fm, name)
        timed(fr.PlanSkeleton, "from_plan")
        timed(fr.PlanRefresher, "__init__", "PlanRefresher()")
        try:
            import flashinfer.mla._batch_mla._backends._fa_common as fac
            timed(fac, "_validate_fa_plan_workload")
        except ImportError:
            pass
    case = SpecPolicyCase(args.variant, args.batch, output_len=args.steps + 40,
                          async_scheduling=False if args.sync else None)
    engine = build_engine(case)
    runner = engine.executor.worker.model_runner
    for builder in runner.attn_metadata_builders:
        timed(builder, "build", f"build[{type(builder).__name__}]")
    timed(runner, "_prepare_inputs")
    for _ in range(30):
        engine.step()
    per_step = []
    before = flashinfer_plan_counts(runner)
    for _ in range(args.steps):
        if not engine.has_unfinished_requests():
            break
        calls.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        ms = (time.perf_counter() - t0) * 1e3
        now = flashinfer_plan_counts(runner)
        replanned = (now[0] - before[0]) + (now[1] - before[1]) > 0
        before = now
        per_step.append((replanned, ms, list(calls)))
    engine.shutdown()
    for flag in (True, False):
        steps = [s for s in per_step if s[0] == flag]
        if not steps:
            continue
        print(f"== steps that {'re-planned' if flag else 'did not re-plan'}: {len(steps)}, "
              f"median step {statistics.median(s[1] for s in steps):.3f} ms")
        by = defaultdict(list)
        for _, _, cs in steps:
            per = defaultdict(float)
            for name, us in cs:
                per[name] += us
            for name, us in per.items():
                by[name].append(us)
        for name, v in sorted(by.items(), key=lambda kv: -statistics.median(kv[1])):
            print(f"   {name:42} steps={len(v):4} median={statistics.median(v):9.1f} us "
                  f"max={max(v):9.1f} us")


_CALLS: list[tuple[str, float]] = []

if __name__ == "__main__":
    main()
