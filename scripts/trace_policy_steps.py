"""Step-by-step trace of the speculation policy's engines (the cases of benchmark_spec_policy.py):
for every engine step after the warm-up, its wall time, what it launched (drafts verified or not,
completed at launch or left in flight) and what the cost model recorded (kind, seconds); then
per case the timed total, the median / p90 / max step, and the slowest steps with their kinds.

Where "auto-nopay" loses time against "never" (the same engine that never drafts), this says
whether the loss is a few dear steps (probes, one-time costs) or every step a little.

With --interleaved the variants' engines (plus auto-nopay without re-probes) are alive at once
and stepped in turn in 16-step blocks, as the cannot-pay GPU test runs them, and every engine's
host phases (schedule, launch, output wait, update, step-time record) and FlashInfer re-plans
are counted per step: the decomposition of docs/performance.md (twelfth session).

Usage: python scripts/trace_policy_steps.py --batch-sizes 1 8 --variants none never auto-nopay \
           [--scheduling default|sync] [--rounds 2] [--json trace.json] [--interleaved]
CPU:   ... --device cpu --dtype float32 --attention-backend TORCH_MLA --enforce-eager
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from vllm.benchmarks.spec_policy import (
    VARIANTS,
    SpecPolicyCase,
    add_engine_args,
    build_engine,
    engine_kwargs,
)


def _hook(engine, log: list, record_policy: bool = True) -> None:
    """Record each launch (verify?, done at launch?), each step's host phases and (with
    `record_policy`) each cost-model observation and decision into the current step's entry
    of `log` (the last one). The policy hooks cost host time of their own; the interleaved
    comparison leaves them out, the phase timers wrap every engine alike."""
    executor = engine.executor
    launch = executor.execute_model_async

    def recording_launch(so):
        handle = launch(so)
        if log:
            log[-1]["launches"].append(("V" if so.scheduled_spec_decode_tokens else "P")
                                       + ("s" if handle.done else "a"))
        return handle
    executor.execute_model_async = recording_launch
    _time_phases(engine, log)
    policy = engine.scheduler.spec_policy
    if record_policy and policy is not None and policy.cost_model is not None:
        model = policy.cost_model
        observe = model.observe_step
        decide = model.decide_step

        def recording_observe(kind, batch, context, seconds):
            if log:
                log[-1]["observed"].append((kind, round(seconds * 1e3, 3)))
            return observe(kind, batch, context, seconds)

        def recording_decide(ids, contexts):
            result = decide(ids, contexts)
            if log:
                _, uniform, decisions = result
                reasons = ([uniform.reason or "draft"] * len(ids) if uniform is not None
                           else [d.reason or "draft" for d in decisions.values()])
                log[-1]["decided"] = {r: reasons.count(r) for r in set(reasons)}
            return result
        model.observe_step = recording_observe
        model.decide_step = recording_decide


# Host phases of a step (their wall time, summed per step): the scheduler's plan, the runner's
# launch, the wait for and the processing of its output.
PHASES = (("scheduler", "schedule"), ("executor", "execute_model"),
          ("executor", "execute_model_async"), ("scheduler", "update_from_output"),
          ("scheduler", "record_step_time"))


def _time_phases(engine, log: list) -> None:
    """Add each phase's host time (us) to the current step's entry of `log` ("phases");
    the output wait is timed inside the launch's handle (get_output)."""
    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if log:
                    phases = log[-1].setdefault("phases", {})
                    phases[name] = phases.get(name, 0.0) + (time.perf_counter() - t0) * 1e6
        return wrapper

    for owner_name, attr in PHASES:
        owner = getattr(engine, owner_name)
        fn = getattr(owner, attr)
        if attr == "execute_model_async":
            def launch(so, _fn=fn):
                handle = _fn(so)
                handle.get_output = timed("get_output", handle.get_output)
                return handle
            fn = launch
        setattr(owner, attr, timed(attr, fn))


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
            # rows: requests still running when the step starts (a speculative batch's
            # requests finish in different steps: its last steps run part-empty)
            log.append({"launches": [], "observed": [], "decided": None,
                        "rows": len(engine.scheduler.running)})
            before = engine._num_generation_tokens
            t0 = time.perf_counter()
            engine.step()
            log[-1]["ms"] = (time.perf_counter() - t0) * 1e3
            log[-1]["tokens"] = engine._num_generation_tokens - before
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


def tail_summary(log: list[dict], batch: int) -> str:
    """Steps with the whole batch running against the tail after the first request finished:
    their count, summed ms, tokens and tok/s (the tail is where a speculative batch loses to
    a plain one that finishes all its requests in the same step)."""
    parts = []
    for name, steps in (("full batch", [s for s in log if s.get("rows") == batch]),
                        ("tail", [s for s in log if s.get("rows", batch) < batch])):
        ms = sum(s["ms"] for s in steps)
        tokens = sum(s.get("tokens", 0) for s in steps)
        rate = f"{tokens / ms * 1e3:.0f} tok/s" if ms else "-"
        parts.append(f"{name}: {len(steps)} steps, {ms:.1f} ms, {tokens} tokens, {rate}")
    return "; ".join(parts)


def trace_interleaved(cases: dict[str, SpecPolicyCase], steps_per_block: int = 16) -> dict:
    """The engines of `cases` alive at once and stepped in turn in blocks (run_interleaved, the
    cannot-pay test's runner), every timed step traced as `trace` does."""
    from vllm.benchmarks.spec_policy import run_interleaved

    logs: dict[str, list[dict]] = {name: [] for name in cases}

    writers: dict[str, str] = {}

    def on_warm(name, engine):
        log = logs[name]
        speculator = engine.executor.worker.model_runner.speculator
        writer = getattr(getattr(speculator, "model", None), "__dict__", {}).get(
            "_context_kv_writer")
        if writer is not None:  # which context-KV write this engine's drafter runs
            writers[name] = "fused" if writer.reason is None else f"per layer ({writer.reason})"
        _hook(engine, log, record_policy=False)
        step = engine.step

        from vllm.benchmarks.spec_step_kinds import flashinfer_plan_counts
        runner = engine.executor.worker.model_runner
        plans = [flashinfer_plan_counts(runner)]

        def traced_step():
            log.append({"launches": [], "observed": [], "decided": None})
            try:
                return step()
            finally:
                # FlashInfer plans made in this step (full, native re-plan): a step that
                # re-plans pays ~0.2-1 ms of host time that a refreshed one does not.
                now = flashinfer_plan_counts(runner)
                log[-1]["plans"] = (now[0] - plans[0][0], now[1] - plans[0][1])
                plans[0] = now
        engine.step = traced_step

    runs = run_interleaved(cases, steps_per_block, on_warm=on_warm)
    out = {"_rounds": runs["_rounds"], "_context_kv": writers}
    for name in cases:
        run = runs[name]
        flat = [ms for block in run["step_ms"] for ms in block]
        log = logs[name][:len(flat)]  # the kept blocks' steps come first
        for entry, ms in zip(log, flat):
            entry["ms"] = ms
        firsts = [block[0] for block in run["step_ms"]]
        rest = [ms for block in run["step_ms"] for ms in block[1:]]
        median = statistics.median(flat)
        out[name] = {
            "variant": run["variant"], "batch": run["batch"], "tok_s": run["tok_s"],
            "steps": len(flat), "block_ms": sum(s for _, s in run["blocks"]) * 1e3,
            "steps_ms": sum(flat), "median_ms": median,
            "first_in_block_median_ms": statistics.median(firsts),
            "rest_median_ms": statistics.median(rest),
            "sum_above_3x_median_ms": sum(m for m in flat if m > 3 * median),
            "slowest": [{"step": i, **log[i]} for i in
                        sorted(range(len(log)), key=lambda i: -log[i]["ms"])[:6]],
            "log": log, "policy": run["policy"]}
    return out


def print_interleaved(result: dict) -> None:
    names = [n for n in result if not n.startswith("_")]
    base = result[names[0]]
    print(f"{'engine':24} {'B':>3} {'tok/s':>8} {'ratio':>6} {'block ms':>9} {'steps ms':>9} "
          f"{'median':>7} {'1st/blk':>7} {'rest':>7} {'>3x med':>8}")
    for name in names:
        r = result[name]
        print(f"{name:24} {r['batch']:>3} {r['tok_s']:8.0f} {r['tok_s'] / base['tok_s']:6.3f} "
              f"{r['block_ms']:9.2f} {r['steps_ms']:9.2f} {r['median_ms']:7.3f} "
              f"{r['first_in_block_median_ms']:7.3f} {r['rest_median_ms']:7.3f} "
              f"{r['sum_above_3x_median_ms']:8.2f}")
    for name, how in result.get("_context_kv", {}).items():
        print(f"-- {name}: context-KV write {how}")
    for name in names:
        r = result[name]
        kinds: dict[str, list[float]] = {}
        for entry in r["log"]:
            kinds.setdefault("+".join(entry["launches"]) or "-", []).append(entry["ms"])
        print(f"-- {name}: by launches: " + ", ".join(
            f"{k}: n={len(v)} med={statistics.median(v):.3f} sum={sum(v):.1f}"
            for k, v in sorted(kinds.items())))
        phases: dict[str, list[float]] = {}
        for entry in r["log"]:
            for k, v in entry.get("phases", {}).items():
                phases.setdefault(k, []).append(v)
        replans = [sum(entry.get("plans", (0, 0))) for entry in r["log"]]
        quarter = max(1, len(replans) // 4)
        print("   FlashInfer re-plans (full + native) per quarter of the steps: "
              + " ".join(str(sum(replans[i:i + quarter])) for i in range(0, len(replans), quarter)))
        if phases:
            print("   host us/step (median): " + ", ".join(
                f"{k}={statistics.median(v):.1f}" for k, v in phases.items()))
        for entry in r["slowest"][:3]:
            print(f"   step {entry['step']:>4} {entry['ms']:7.2f} ms launches={entry['launches']} "
                  f"observed={entry['observed']} decided={entry['decided']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--variants", nargs="+", default=["none", "never", "auto-nopay"],
                        choices=VARIANTS)
    parser.add_argument("--scheduling", choices=("default", "sync"), default="default")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--warmup-steps", type=int, default=32)
    add_engine_args(parser)
    parser.add_argument("--freeze-gc", action="store_true",
                        help="gc.freeze the start-up heap after the build, as the API server "
                             "does (an A/B)")
    parser.add_argument("--interleaved", action="store_true",
                        help="all variants' engines alive at once, stepped in turn in blocks "
                             "of 16 steps (the cannot-pay test's runner); adds the variant "
                             "'auto-nopay-noprobe' (auto-nopay without re-probes)")
    parser.add_argument("--defer-context-kv", action="store_true")
    parser.add_argument("--context-kv-ab", action="store_true",
                        help="with --interleaved: adds 'never-perlayer', the never engine with "
                             "the per-layer context-KV write (VLLM_FUSED_DRAFT_CONTEXT_KV=0)")
    parser.add_argument("--prompt-stagger", type=int, nargs="+", default=[0], metavar="TOKENS",
                        help="request i's prompt is i * TOKENS longer (0: equal prompts, whose "
                             "plain engine crosses block boundaries in lock-step); several "
                             "values run one after another")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.interleaved:
        results = []
        for batch, stagger in [(b, t) for b in args.batch_sizes for t in args.prompt_stagger]:
            for _ in range(args.rounds):
                cases = {}
                extra_variants = ["auto-nopay-noprobe"] + (["never-perlayer"]
                                                          if args.context_kv_ab else [])
                for variant in args.variants + extra_variants:
                    extra = {}
                    name = None
                    if variant == "never-perlayer":
                        variant, name = "never", "never-perlayer"
                        extra["fused_context_kv"] = False
                    elif variant == "auto-nopay-noprobe":
                        variant = "auto-nopay"
                        extra["cost_model_config"] = (("probe_interval", 10 ** 6),
                                                      ("max_probe_interval", 10 ** 6))
                    name = name or variant + ("-noprobe" if extra else "")
                    if variant != "none" and args.defer_context_kv:
                        extra["defer_context_kv"] = True
                    cases[name] = SpecPolicyCase(
                        variant, batch, output_len=args.output_len,
                        warmup_steps=args.warmup_steps, **engine_kwargs(args),
                        async_scheduling=None if args.scheduling == "default" else False,
                        prompt_stagger=stagger, **extra)
                result = trace_interleaved(cases)
                result["_prompt_stagger"] = stagger
                print(f"== B={batch} scheduling={args.scheduling} prompt_stagger={stagger} "
                      f"rounds={result['_rounds']}")
                print_interleaved(result)
                results.append(result)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1, default=str)
        return
    results = []
    for _ in range(args.rounds):
        for batch in args.batch_sizes:
            for variant in args.variants:
                case = SpecPolicyCase(
                    variant, batch, output_len=args.output_len, warmup_steps=args.warmup_steps,
                    **engine_kwargs(args),
                    async_scheduling=None if args.scheduling == "default" else False,
                    prompt_stagger=args.prompt_stagger[0])
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
        print("   " + tail_summary(r["log"], r["batch"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
