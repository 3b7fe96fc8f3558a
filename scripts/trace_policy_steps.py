"""Step-by-step trace of the speculation policy's engines (the cases of benchmark_spec_policy.py):
for every engine step after the warm-up, its wall time, what it launched (drafts verified or not,
completed at launch or left in flight) and what the cost model recorded (kind, seconds); then
per case the timed total, the median / p90 / max step, and the slowest steps with their kinds.

Where "auto-nopay" loses time against "never" (the same engine that never drafts), this says
whether the loss is a few dear steps (probes, one-time costs) or every step a little.

Usage: python scripts/trace_policy_steps.py --batch-sizes 1 8 --variants none never auto-nopay \
           [--scheduling default|sync] [--rounds 2] [--json trace.json]
CPU:   ... --device cpu --dtype float32 --attention-backend TORCH_MLA --enforce-eager
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from vllm.benchmarks.spec_policy import VARIANTS, SpecPolicyCase, build_engine


def _hook(engine, log: list) -> None:
    """Record each launch (verify?, done at launch?) and each cost-model observation into the
    current step's entry of `log` (the last one)."""
    executor = engine.executor
    launch = executor.execute_model_async

    def recording_launch(so):
        handle = launch(so)
        if log:
            log[-1]["launches"].append(("V" if so.scheduled_spec_decode_tokens else "P")
                                       + ("s" if handle.done else "a"))
        return handle
    executor.execute_model_async = recording_launch
    policy = engine.scheduler.spec_policy
    if policy is not None and policy.cost_model is not None:
        model = policy.cost_model
        observe = model.observe_step
        decide = model.decide

        def recording_observe(kind, batch, context, seconds):
            if log:
                log[-1]["observed"].append((kind, round(seconds * 1e3, 3)))
            return observe(kind, batch, context, seconds)

        def recording_decide(candidates):
            decisions = decide(candidates)
            if log:
                reasons = [d.reason or "draft" for d in decisions.values()]
                log[-1]["decided"] = {r: reasons.count(r) for r in set(reasons)}
            return decisions
        model.observe_step = recording_observe
        model.decide = recording_decide


def trace(case: SpecPolicyCase, freeze_gc: bool = False) -> dict:
    import torch

    from vllm.utils.gc_utils import freeze_gc_heap, unfreeze_gc_heap
    engine = build_engine(case)
    if freeze_gc:  # as the API server does before it serves (A/B of gc_utils.py)
        freeze_gc_heap()
    cuda = case.device.startswith("cuda")
    try:
        for _ in range(case.warmup_steps):
            if engine.has_unfinished_requests():
                engine.step()
        log: list[dict] = []
        _hook(engine, log)
        tokens_before = engine._num_generation_tokens
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            log.append({"launches": [], "observed": [], "decided": None})
            t0 = time.perf_counter()
            engine.step()
            log[-1]["ms"] = (time.perf_counter() - t0) * 1e3
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tokens = engine._num_generation_tokens - tokens_before
    finally:
        engine.shutdown()
        if freeze_gc:
            unfreeze_gc_heap()
    ms = [s["ms"] for s in log]
    ordered = sorted(ms)
    slowest = sorted(range(len(log)), key=lambda i: -ms[i])[:6]
    return {"variant": case.variant, "batch": case.batch, "tok_s": tokens / seconds,
            "steps": len(log), "total_ms": seconds * 1e3, "median_ms": statistics.median(ms),
            "p90_ms": ordered[int(0.9 * (len(ordered) - 1))], "max_ms": ordered[-1],
            "sum_above_3x_median_ms": sum(m for m in ms if m > 3 * statistics.median(ms)),
            "slowest": [{"step": i, **log[i]} for i in slowest], "log": log}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--variants", nargs="+", default=["none", "never", "auto-nopay"],
                        choices=VARIANTS)
    parser.add_argument("--scheduling", choices=("default", "sync"), default="default")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--warmup-steps", type=int, default=32)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention-backend", default="FLASHINFER_MLA")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--freeze-gc", action="store_true",
                        help="gc.freeze the start-up heap after the build, as the API server "
                             "does (an A/B)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = []
    for _ in range(args.rounds):
        for batch in args.batch_sizes:
            for variant in args.variants:
                case = SpecPolicyCase(
                    variant, batch, output_len=args.output_len, warmup_steps=args.warmup_steps,
                    device=args.device, dtype=args.dtype,
                    attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
                    async_scheduling=None if args.scheduling == "default" else False)
                results.append(trace(case, args.freeze_gc))
    print(f"{'variant':11} {'B':>3} {'tok/s':>8} {'steps':>5} {'total ms':>9} {'median':>7} "
          f"{'p90':>7} {'max':>7} {'>3x med':>8}")
    for r in results:
        print(f"{r['variant']:11} {r['batch']:>3} {r['tok_s']:8.0f} {r['steps']:>5} "
              f"{r['total_ms']:9.2f} {r['median_ms']:7.3f} {r['p90_ms']:7.3f} {r['max_ms']:7.2f} "
              f"{r['sum_above_3x_median_ms']:8.2f}")
    for r in results:
        print(f"-- {r['variant']} B={r['batch']}: slowest steps")
        for s in r["slowest"]:
            print(f"   step {s['step']:>4} {s['ms']:7.2f} ms launches={s['launches']} "
                  f"observed={s['observed']} decided={s['decided']}")
        kinds = {}
        for s in r["log"]:
            key = "+".join(s["launches"]) or "-"
            kinds.setdefault(key, []).append(s["ms"])
        print("   by launches: " + ", ".join(
            f"{k}: n={len(v)} med={statistics.median(v):.3f} sum={sum(v):.1f}"
            for k, v in sorted(kinds.items())))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
