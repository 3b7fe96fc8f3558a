"""Host cost of each phase of a decode step: plain engine vs a speculative engine that does not
draft vs one that drafts (runs on CPU or GPU; the built-in tiny model by default).

Every phase is a perf_counter accumulator around one function (about a microsecond each, no
profiler distortion); the table gives the median over the timed steps of each phase's time per
step, in ms. On CPU the model forward costs far more than on a GPU, so compare the phases that
are not the forward (`runner._forward` and the draft block forward are listed apart).

Modes: "plain" (no speculation), "nodraft" (DSpark with disable_by_batch_size=1: the policy lets
nobody draft), "draft" (DSpark drafting every step), "nopay" (DSpark with the "auto" policy and a
cost model told every draft is rejected).

Usage: python scripts/probe_spec_step.py --device cpu --batch 1 8 32 [--modes plain nodraft draft]
       [--steps 60] [--repeats 2] [--json out.json]
Probe steps of the "auto" policy vs its plain steps (a second table: wall time and FlashInfer
full plans / native re-plans per kind of step; many probes with --probe-interval):
       python scripts/probe_spec_step.py --device cuda --dtype bfloat16 \
           --attention-backend FLASHINFER_MLA --batch 1 8 --modes nopay draft --steps 200 \
           --probe-interval 8
GPU:   python scripts/probe_spec_step.py --device cuda --dtype bfloat16 \
           --attention-backend FLASHINFER_MLA --batch 1 8 32 --modes plain nodraft nopay draft \
           --steps 200 --repeats 2 --count-ops 10 --json probe_spec_gpu.json
With CUDA graphs the target forward and the draft block step are replays: they show under
`CudaGraphManager.replay` (host side of both) and `runner._copy_step_output (incl. wait)` (the wait
for the device), not under the forward labels.
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import time
from collections import defaultdict

from vllm.benchmarks.datasets import spec_bench_prompt
from vllm.benchmarks.spec_step_kinds import (StepKinds, host_written_plans, plan_cache_put_backs,
                                             set_probe_interval)

MODES = {"plain": None, "nodraft": 1, "draft": "always", "nopay": "auto"}

# One accumulator per label for the current step; flushed into _STEPS after each step.
_CURRENT: dict[str, float] = defaultdict(float)
_CALLS: dict[str, int] = defaultdict(int)  # calls of each wrapped function, all steps
_STEPS: list[dict[str, float]] = []
_WRAPPED: list[tuple[object, str, object]] = []
# --count-ops: ATen ops (views excluded) per step, charged to the innermost wrapped phase. On a
# CUDA host each op costs ~5-10 us of launch/dispatch, which a CPU run's timings hide.
_STACK: list[str] = ["(engine, unwrapped)"]
_OPS: dict[str, int] = defaultdict(int)
# Phases whose ops are model forwards (device work a CUDA graph replays with one launch).
_FORWARD_LABELS = ("runner._forward (target model)", "speculator precompute_context (in fwd)",
                   "speculator block forward (draft model)")


def _op_counter():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not any(a.alias_info is not None and not a.alias_info.is_write
                       for a in func._schema.returns):
                _OPS[_STACK[-1]] += 1
            return func(*args, **(kwargs or {}))

    return Mode()


_REBUILD_LABEL = "    FI page lists rebuilt on the device"


def _wrap(owner, name: str, label: str) -> None:
    original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)
    if original is None:
        return
    if isinstance(original, staticmethod):
        return
    # a classmethod (PlanSkeleton.from_plan) is timed around its function and stays one
    bound = original.__func__ if isinstance(original, classmethod) else original

    @functools.wraps(bound)
    def timed(*args, **kwargs):
        _STACK.append(label)
        _CALLS[label] += 1
        start = time.perf_counter()
        try:
            return bound(*args, **kwargs)
        finally:
            _CURRENT[label] += time.perf_counter() - start
            _STACK.pop()

    _WRAPPED.append((owner, name, original))
    setattr(owner, name, classmethod(timed) if isinstance(original, classmethod) else timed)


def _unwrap() -> None:
    while _WRAPPED:
        owner, name, original = _WRAPPED.pop()
        setattr(owner, name, original)


def _instrument(engine) -> None:
    from vllm.v1.worker.gpu import model_runner
    runner_cls = model_runner.GPUModelRunner
    sched_cls = type(engine.scheduler)
    _wrap(sched_cls, "schedule", "scheduler.schedule")
    _wrap(sched_cls, "update_from_output", "scheduler.update_from_output")
    _wrap(type(engine), "_process_step", "engine._process_step (incl. update_from_output)")
    _wrap(runner_cls, "execute_model_async", "runner.execute_model (all)")
    _wrap(runner_cls, "_update_states", "runner._update_states")
    _wrap(runner_cls, "_prepare_inputs", "runner._prepare_inputs")
    if runner_cls.__dict__.get("_advance_graph_step") is not None:
        _wrap(runner_cls, "_advance_graph_step", "  runner._advance_graph_step (carry, or refuse)")
    _wrap(runner_cls, "_forward", "runner._forward (target model)")
    _wrap(runner_cls, "_sample", "runner._sample")
    _wrap(runner_cls, "_copy_step_output", "runner._copy_step_output (incl. wait)")
    _wrap(runner_cls, "_finish_step", "runner._finish_step (incl. _propose)")
    _wrap(runner_cls, "_propose", "runner._propose (incl. draft forward)")
    if runner_cls.__dict__.get("_sample_plain") is not None:
        _wrap(runner_cls, "_sample_plain", "runner._sample_plain (no drafts verified)")
    for manager in getattr(engine.executor.worker.model_runner, "_graph_managers", {}).values():
        _wrap(type(manager), "replay", "CudaGraphManager.replay (target + draft graphs)")
        break
    runner = engine.executor.worker.model_runner
    spec = runner.speculator
    if spec is not None:
        from vllm.v1.worker.gpu.spec_decode.block_speculator import BlockSpeculator
        from vllm.v1.worker.gpu.spec_decode.speculator import Speculator
        _wrap(Speculator, "_build_draft_attn_metadata", "speculator draft attn metadata")
        # Inside it: the fused input write comes before; the backends' builders (FlashInfer:
        # plan / refresh of the draft wrapper) are called from build_attn_metadata.
        from vllm.v1.worker.gpu.spec_decode import speculator as speculator_module
        _wrap(speculator_module, "build_attn_metadata",
              "speculator draft: build_attn_metadata (backend builders)")
        _wrap(BlockSpeculator, "_write_block", "speculator block inputs write")
        _wrap(BlockSpeculator, "_block_step", "speculator block forward (draft model)")
        _wrap(BlockSpeculator, "precompute_context", "speculator precompute_context (in fwd)")
        # The early draft step (before the wait): its whole, and, with the device lowering on,
        # the lowering (the draft replay inside it is under CudaGraphManager.replay).
        if runner_cls.__dict__.get("_prepare_draft_early") is not None:
            _wrap(runner_cls, "_prepare_draft_early", "runner._prepare_draft_early (before the wait)")
        from vllm.v1.worker.gpu.spec_decode import block_speculator as block_module
        _wrap(block_module, "lower_attn_metadata_on_device",
              "speculator early plan lowered on the device")
        # Finer: the early path's parts (the inputs write is labelled above; the draft replay is
        # under CudaGraphManager.replay), and the verified step's host counts after the wait.
        _wrap(BlockSpeculator, "prepare_early",
              "  speculator.prepare_early (write, plan advance, draft launch)")
        _wrap(block_module, "advance_attn_metadata_on_device",
              "    speculator early plans advanced on the device")
        _wrap(runner_cls, "_early_block_terms", "  runner._early_block_terms")
        _wrap(model_runner, "apply_verified_step", "  runner apply_verified_step (host counts)")
    try:
        from vllm.v1.attention.backends.mla.flashinfer_mla import FlashInferMLAMetadataBuilder
    except ImportError:
        FlashInferMLAMetadataBuilder = None
    if FlashInferMLAMetadataBuilder is not None:
        _wrap(FlashInferMLAMetadataBuilder, "build", "FlashInfer MLA builder build (all groups)")
        from vllm.v1.attention.backends.mla import flashinfer_mla
        from vllm.v1.attention.backends.mla.common import MLACommonMetadataBuilder
        # Inside build: the common MLA metadata, the host CSR, and the plan (one of: refresh,
        # native re-plan, FlashInfer's full plan; the skeleton read-back after a real plan).
        # (The common build is every MLA builder's: with TORCH_MLA it is that builder's whole.)
        _wrap(MLACommonMetadataBuilder, "build", "  MLA common build (every MLA builder)")
        _wrap(flashinfer_mla, "plan_hopper_decode", "  FI host CSR plan_hopper_decode")
        _wrap(flashinfer_mla, "_plan", "  FI _plan (refresh / re-plan / full)")
        _wrap(flashinfer_mla, "_refresh", "    FI refresh try (incl. CSR upload)")
        _wrap(flashinfer_mla, "_native_replan", "    FI native re-plan (incl. CSR upload)")
        _wrap(flashinfer_mla, "_adopt_plan", "    FI skeleton read-back after a plan")
        from vllm.v1.attention.backends.mla.flashinfer_plan_refresh import (PlanRefresher,
                                                                            PlanSkeleton)
        # The read-back's parts: the skeleton itself, and keeping the plan by its chunk
        # structure (the plan cache's store: a gather, a pinned copy, an upload)
        _wrap(PlanSkeleton, "from_plan", "      FI PlanSkeleton.from_plan")
        _wrap(PlanRefresher, "keep", "      FI plan kept by its structure (PlanRefresher.keep)")
        _wrap(PlanRefresher, "rebuild_page_lists_on_device", _REBUILD_LABEL)
        # Every device advance / lowering of a held plan (target and draft groups): the host
        # checks, then the one lowering launch.
        _wrap(FlashInferMLAMetadataBuilder, "_lower_held_plan",
              "    FI held plan lowered (checks + launch, all groups)")
        _wrap(PlanRefresher, "lower_on_device", "      FI lower_on_device launch")


def _kinds_table(results: list[dict]) -> str:
    lines = ["| mode B | step kind | steps | median ms | mean ms | max ms | full FlashInfer plans "
             "/ step | native re-plans / step | per group: refresh / native / full per step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for kind, k in sorted(r.get("step_kinds", {}).items()):
            lines.append(f"| {r['mode']} B={r['batch']} | {kind} | {k['steps']} | "
                         f"{k['median_ms']:.3f} | {k['mean_ms']:.3f} | {k['max_ms']:.3f} | "
                         f"{k['full_plans_per_step']:.2f} | {k['native_replans_per_step']:.2f} | "
                         + "; ".join(f"g{g} {p['refresh']:.2f}/{p['native']:.2f}/{p['full']:.2f}"
                                     for g, p in enumerate(k.get("plans_per_step_by_group", [])))
                         + " |")
    return "\n".join(lines)


_GC_START: list[float] = []


def _kind_phases_table(results: list[dict], top: int = 16) -> str:
    """Mean ms per step of each phase by kind of step: what a re-planned step pays beyond an
    advanced one (the kinds split off steps that made a FlashInfer plan). The `top` phases by
    their largest mean are listed."""
    cols = [(f"{r['mode']} B={r['batch']} {kind} ({k['steps']})", k["phases_mean_ms"])
            for r in results for kind, k in sorted(r.get("step_kinds", {}).items())]
    if not cols:
        return ""
    labels = sorted({label for _, p in cols for label in p},
                    key=lambda label: -max(p.get(label, 0.0) for _, p in cols))[:top]
    lines = ["| phase (mean ms/step) | " + " | ".join(c for c, _ in cols) + " |",
             "|" + "---|" * (len(cols) + 1)]
    lines += [f"| {label} | " + " | ".join(f"{p.get(label, 0.0):.3f}" for _, p in cols) + " |"
              for label in labels]
    return "\n".join(lines)


def _gc_callback(phase: str, info: dict) -> None:
    """Python's cyclic GC runs inside whatever phase allocates: its time is reported apart
    (a step that allocates more objects per request pays it more often)."""
    if phase == "start":
        _GC_START.append(time.perf_counter())
    elif _GC_START:
        _CURRENT[f"python gc, generation {info['generation']}"] += (time.perf_counter()
                                                                    - _GC_START.pop())


def _engine(mode: str, batch: int, args):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    spec = None
    if MODES[mode] is not None:
        spec = {"method": "dspark", "num_speculative_tokens": args.k,
                "disable_by_batch_size": None if MODES[mode] == "always" else MODES[mode]}
    extra = {} if args.device == "cuda" else {"device": args.device}
    return LLMEngine.from_engine_args(EngineArgs(
        model=args.model, dtype=args.dtype,
        max_model_len=args.context + (args.steps + args.warmup + args.count_ops) * (args.k + 1) + 64,
        attention_backend=args.attention_backend, speculative_config=spec,
        max_num_seqs=batch, max_num_batched_tokens=max(4096, batch * (args.context + 1)),
        enforce_eager=args.enforce_eager, seed=0, async_scheduling=False, **extra))


def probe(mode: str, batch: int, args) -> dict:
    from vllm.sampling_params import SamplingParams
    engine = _engine(mode, batch, args)
    try:
        if mode == "nopay":
            engine.scheduler.spec_policy.cost_model.acceptance_override = 1.0
        total = (args.steps + args.warmup + args.count_ops) * (args.k + 1) + 8
        params = SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"r{i}", spec_bench_prompt(i, args.context), params)
        for _ in range(args.warmup):
            engine.step()
        if mode == "nopay" and args.probe_interval:
            set_probe_interval(engine.scheduler.spec_policy.cost_model, args.probe_interval)
        kinds = StepKinds(engine, split_replans=True)
        _instrument(engine)
        gc.callbacks.append(_gc_callback)
        _STEPS.clear()
        _CURRENT.clear()
        step_ms = []
        model_runner = engine.executor.worker.model_runner
        advances_before = getattr(model_runner, "graph_step_advances", 0)
        rebuilds_before = _CALLS[_REBUILD_LABEL]
        put_backs_before = sum(plan_cache_put_backs(model_runner))
        host_plans_before = sum(host_written_plans(model_runner))
        for _ in range(args.steps):
            kinds.before()
            t0 = time.perf_counter()
            engine.step()
            step_ms.append((time.perf_counter() - t0) * 1e3)
            kinds.after(step_ms[-1], dict(_CURRENT))
            _STEPS.append(dict(_CURRENT))
            _CURRENT.clear()
        kinds.restore()
        # graph steps that carried the previous step's metadata (the runner's
        # _advance_graph_step; VLLM_GRAPH_STEP_ADVANCE=0 turns it off)
        advanced = getattr(model_runner, "graph_step_advances", 0) - advances_before
        rebuilt = _CALLS[_REBUILD_LABEL] - rebuilds_before
        put_back = sum(plan_cache_put_backs(model_runner)) - put_backs_before
        host_written = sum(host_written_plans(model_runner)) - host_plans_before
        ops = {}
        if args.count_ops:
            _OPS.clear()
            with _op_counter():
                for _ in range(args.count_ops):
                    engine.step()
            ops = {label: n / args.count_ops for label, n in _OPS.items()}
            ops["= outside model forwards"] = sum(
                n for label, n in ops.items() if label not in _FORWARD_LABELS)
        _unwrap()
        gc.callbacks.remove(_gc_callback)
        if args.cprofile:
            _cprofile_steps(engine, args.cprofile, f"{mode} B={batch}", args.cprofile_top,
                            args.cprofile_filter)
        labels = sorted({k for s in _STEPS for k in s})
        phases = {label: statistics.median(s.get(label, 0.0) for s in _STEPS) * 1e3
                  for label in labels if not label.startswith("python gc")}
        for label in labels:  # rare: the mean per step, not the median (which would be 0)
            if label.startswith("python gc"):
                phases[label + " (mean)"] = sum(s.get(label, 0.0) for s in _STEPS) / len(_STEPS) * 1e3
        # Per-step host time outside the model forwards (the comparable part on CPU), and the
        # draft pass's own host time (its block forward excluded).
        fwd = [s.get("runner._forward (target model)", 0.0)
               + s.get("speculator block forward (draft model)", 0.0) for s in _STEPS]
        phases["= step minus model forwards"] = statistics.median(
            t - f * 1e3 for t, f in zip(step_ms, fwd))
        phases["= draft pass minus block forward"] = statistics.median(
            (s.get("runner._propose (incl. draft forward)", 0.0)
             - s.get("speculator block forward (draft model)", 0.0)) for s in _STEPS) * 1e3
        stats = engine.scheduler.get_stats().get("spec_decode") or {}
        return {"mode": mode, "batch": batch, "step_ms": statistics.median(step_ms),
                "phases_ms": phases, "ops_per_step": ops, "policy": stats.get("policy"),
                "mean_acceptance_length": stats.get("mean_acceptance_length"),
                "step_kinds": kinds.summary(),
                "graph_step_advances_per_step": advanced / len(step_ms),
                "page_list_rebuilds_per_step": rebuilt / len(step_ms),
                "plan_put_backs_per_step": put_back / len(step_ms),
                "host_plans_per_step": host_written / len(step_ms),
                "step_mean_ms": statistics.fmean(step_ms)}
    finally:
        _unwrap()
        if _gc_callback in gc.callbacks:
            gc.callbacks.remove(_gc_callback)
        engine.shutdown()


def _cprofile_steps(engine, steps: int, title: str, top: int, only: str | None = None) -> None:
    """--cprofile: where the host time of `steps` more steps goes, by function (own time and
    cumulative time; cProfile roughly doubles Python's cost, so read shares, not ms). `only`:
    a regular expression on "file:line(function)" that the listed rows must match."""
    import cProfile
    import io
    import pstats
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        stats = pstats.Stats(profiler, stream=buf)
        stats.sort_stats(key).print_stats(*([only] if only else []), top)
        text = buf.getvalue()
        body = text[text.find("   ncalls"):]
        print(f"\n#### cProfile {title}, {steps} steps, by {key} (per-call times in s)\n{body}",
              flush=True)


def _table(results: list[dict]) -> str:
    labels: list[str] = []
    for r in results:
        for label in r["phases_ms"]:
            if label not in labels:
                labels.append(label)
    head = ["phase (median ms/step)"] + [f"{r['mode']} B={r['batch']}" for r in results]
    rows = [["engine.step (wall)"] + [f"{r['step_ms']:.3f}" for r in results]]
    for label in labels:
        rows.append([label] + [f"{r['phases_ms'].get(label, 0.0):.3f}" for r in results])
    op_labels: list[str] = []
    for r in results:
        for label in r.get("ops_per_step", {}):
            if label not in op_labels:
                op_labels.append(label)
    for label in op_labels:
        rows.append([f"ATen ops/step: {label}"]
                    + [f"{r['ops_per_step'].get(label, 0):.1f}" for r in results])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attention-backend", default="TORCH_MLA")
    parser.add_argument("--model", default=None, help="None: the built-in tiny model")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--modes", nargs="+", default=["plain", "nodraft", "draft"],
                        choices=list(MODES))
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per (mode, batch); each phase keeps its lowest median")
    parser.add_argument("--count-ops", type=int, default=0, metavar="STEPS",
                        help="after the timed steps, count ATen ops per phase over STEPS steps")
    parser.add_argument("--probe-interval", type=int, default=0, metavar="STEPS",
                        help="nopay: the policy re-probes every STEPS timed steps (0: its own "
                             "schedule, 32 doubling to 1024); the step-kind table then times "
                             "many probe steps against the plain ones")
    parser.add_argument("--cprofile", type=int, default=0, metavar="STEPS",
                        help="after the timed steps, cProfile STEPS more steps and print the top "
                             "functions by own and cumulative time")
    parser.add_argument("--cprofile-top", type=int, default=40)
    parser.add_argument("--cprofile-filter", default=None, metavar="REGEX",
                        help="list only the profiled functions whose file:line(name) matches")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.device == "cpu":
        import torch
        torch.set_num_threads(1)
    results = []
    for batch in args.batch:
        for mode in args.modes:
            # A shared machine adds bursts of noise: keep each phase's best median of the runs.
            runs = [probe(mode, batch, args) for _ in range(args.repeats)]
            r = dict(runs[0], step_ms=min(x["step_ms"] for x in runs))
            r["phases_ms"] = {label: min(x["phases_ms"].get(label, 0.0) for x in runs)
                              for label in runs[0]["phases_ms"]}
            r["ops_per_step"] = runs[-1]["ops_per_step"]
            r["step_kinds"] = runs[-1]["step_kinds"]
            results.append(r)
            print(f"{mode:8s} B={batch:<3d} step {r['step_ms']:.3f} ms, graph steps advanced "
                  f"{r['graph_step_advances_per_step']:.2f} / step, page lists rebuilt "
                  f"{r['page_list_rebuilds_per_step']:.2f} / step, kept plans put back "
                  f"{r['plan_put_backs_per_step']:.2f} / step (host-written "
                  f"{r['host_plans_per_step']:.2f}), mean step "
                  f"{r['step_mean_ms']:.3f} ms", flush=True)
    print(_table(results))
    print()
    print(_kinds_table(results))
    print()
    print(_kind_phases_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
