"""Host time per engine step of the speculation-policy cases, side by side, without a profiler.

Why: `diff_step_profiles.py` says WHERE one engine's host time exceeds another's, but cProfile
roughly doubles Python's cost, so it cannot say HOW MUCH a cut saves. This script builds every
--variants engine at once ("none", "never", "auto-nopay-noprobe", ...), replaces each model
forward by fixed outputs (vllm/benchmarks/host_stub.py: what is left is the engine's host
work), warms them up, then steps them in turn in blocks of --block steps and reports each
engine's median host time per step (this thread's CPU time: time descheduled on a shared box
does not count) and its ratio to the first variant. Interleaved blocks put every engine under
the same machine state (the box's load moves medians by more than the cuts being measured).

On a CPU box the step's device preparation runs as torch ops (prepare_step_torch) where a GPU
runs ONE Triton launch whatever the number of KV cache groups; its time is reported apart and
taken out of the "GPU-like" column, which is what a GPU node's host would pay (less the
launch itself). `--phases` also times the step's main phases (one clock wrapper each, ~1 us
per call, so the step times grow a little) and lists each one's median per variant.

`--prompt-stagger 0 2` builds every variant once per stagger (engines named `variant@stagger`)
in the same process: what requests crossing KV blocks in different steps cost a step, read
within one machine state. Such a batch has a crossing in about half its steps, so its step
times are bimodal and the mean column, not the median, is what its tok/s follows.

    python3 scripts/time_step_host.py --variants none never auto-nopay-noprobe --batch 8
    python3 scripts/time_step_host.py --variants none --batch 8 --prompt-stagger 0 2
"""
from __future__ import annotations

import argparse
import statistics
import time

from vllm.benchmarks.host_stub import stub_forward
from vllm.benchmarks.spec_policy import VARIANTS, SpecPolicyCase, build_engine

NOPROBE = "auto-nopay-noprobe"  # "auto-nopay" without re-probes (as diff_step_profiles.py)

_PREP = [0.0]  # thread CPU seconds spent in prepare_step_torch since the last reset
_PHASES: dict[str, float] = {}  # --phases: label -> thread CPU seconds in the current step


def _wrap_phase(owner, name: str, label: str) -> None:
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            _PHASES[label] = _PHASES.get(label, 0.0) + time.thread_time() - start

    setattr(owner, name, timed)


def _time_phases() -> None:
    """Clock wrappers on the classes (every engine built afterwards is timed)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as Runner
    for owner, name, label in (
            (Scheduler, "schedule", "scheduler.schedule"),
            (Scheduler, "update_from_output", "scheduler.update_from_output"),
            (Scheduler, "record_step_time", "scheduler.record_step_time"),
            (LLMEngine, "_process_step", "engine._process_step (incl. the two above)"),
            (Runner, "execute_model_async", "runner.execute_model_async"),
            (Runner, "_update_states", "  runner._update_states"),
            (Runner, "_prepare_inputs", "  runner._prepare_inputs (incl. prep)"),
            (Runner, "_sample", "  runner._sample"),
            (Runner, "_launched", "  runner._launched"),
            (Runner, "_collect", "runner._collect")):
        _wrap_phase(owner, name, label)


def _time_prep() -> None:
    """Accumulate prepare_step_torch's time (the input builder's reference is patched)."""
    from vllm.v1.worker.gpu import input_batch

    original = input_batch.prepare_step_torch

    def timed(*args, **kwargs):
        start = time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            _PREP[0] += time.thread_time() - start

    input_batch.prepare_step_torch = timed


def _case(name: str, args, stagger: int) -> SpecPolicyCase:
    variant, extra = name, {}
    if name == NOPROBE:
        variant = "auto-nopay"
        extra["cost_model_config"] = (("probe_interval", 10 ** 6),
                                      ("max_probe_interval", 10 ** 6))
    blocks = args.rounds * args.block
    return SpecPolicyCase(variant, args.batch, output_len=args.warmup_steps + blocks + 16,
                          warmup_steps=args.warmup_steps, device=args.device, dtype=args.dtype,
                          attention_backend=args.attention_backend, enforce_eager=True,
                          async_scheduling=None if args.scheduling == "default" else False,
                          prompt_stagger=stagger,
                          # all engines are alive at once: 1 GiB of KV cache each on a GPU
                          kv_cache_memory_bytes=(1 << 30) if args.device == "cuda" else None,
                          **extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=["none", "never", NOPROBE],
                        choices=VARIANTS + (NOPROBE,))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--block", type=int, default=25, help="steps per engine per round")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--warmup-steps", type=int, default=64)
    parser.add_argument("--scheduling", choices=("default", "sync"), default="default")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attention-backend", default="TORCH_MLA")
    parser.add_argument("--phases", action="store_true", help="also time the main phases")
    parser.add_argument("--prompt-stagger", type=int, nargs="+", default=[0],
                        help="request i's prompt is this many x i tokens longer (SpecPolicyCase): "
                             "the requests then cross KV blocks in different steps; several "
                             "values build every variant once per value, in one process")
    args = parser.parse_args()
    if args.block < 1 or args.rounds < 1:
        parser.error(f"--block {args.block} / --rounds {args.rounds}: both must be >= 1")
    if any(s < 0 for s in args.prompt_stagger) or len(set(args.prompt_stagger)) != len(
            args.prompt_stagger):
        parser.error(f"--prompt-stagger {args.prompt_stagger}: give distinct values >= 0")
    several = len(args.prompt_stagger) > 1
    cases = {(f"{name}@{stagger}" if several else name): (name, stagger)
             for stagger in args.prompt_stagger for name in args.variants}
    _time_prep()
    if args.phases:
        _time_phases()
    engines = {}
    try:
        for name, (variant, stagger) in cases.items():
            case = _case(variant, args, stagger)
            engine = engines[name] = build_engine(case)
            stub_forward(engine.executor.worker.model_runner)
            for _ in range(case.warmup_steps):
                engine.step()
        steps = {name: [] for name in engines}  # (host s, prep s) per step
        phases = {name: {} for name in engines}  # label -> seconds per step
        for _ in range(args.rounds):
            for name, engine in engines.items():
                for _ in range(args.block):
                    if not engine.has_unfinished_requests():
                        raise RuntimeError(f"{name}: the requests finished early")
                    _PREP[0] = 0.0
                    _PHASES.clear()
                    start = time.thread_time()
                    engine.step()
                    steps[name].append((time.thread_time() - start, _PREP[0]))
                    for label, seconds in _PHASES.items():
                        phases[name].setdefault(label, []).append(seconds)
    finally:
        for engine in engines.values():
            engine.shutdown()
    base = next(iter(cases))
    med = {n: (statistics.median(h for h, _ in s), statistics.median(h - p for h, p in s),
               statistics.median(p for _, p in s), statistics.fmean(h - p for h, p in s))
           for n, s in steps.items()}
    print(f"B={args.batch}, {args.rounds} rounds of {args.block} steps per engine, "
          f"scheduling={args.scheduling}, device={args.device}, forward stubbed")
    print(f"| variant | host us/step | prep (torch) us | GPU-like us (host - prep) | "
          f"GPU-like mean us | mean over {base} us | GPU-like over {base} us | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (host, like, prep, mean) in med.items():
        print(f"| {name} | {host * 1e6:.1f} | {prep * 1e6:.1f} | {like * 1e6:.1f} | "
              f"{mean * 1e6:.1f} | {(mean - med[base][3]) * 1e6:+.1f} | "
              f"{(like - med[base][1]) * 1e6:+.1f} | {like / med[base][1]:.3f} |")
    if args.phases:
        labels = sorted({label for p in phases.values() for label in p})
        print(f"\n| phase (median us/step; steps without it count 0) | "
              + " | ".join(phases) + " |")
        print("|---|" + "---|" * len(phases))
        for label in labels:
            cells = []
            for name in phases:
                values = phases[name].get(label, [])
                values = values + [0.0] * (len(steps[name]) - len(values))
                cells.append(f"{statistics.median(values) * 1e6:.1f}")
            print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
