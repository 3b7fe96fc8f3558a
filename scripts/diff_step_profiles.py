"""Where one engine's host time per step exceeds another's, function by function: the engines of
the speculation-policy cases (vllm.benchmarks.spec_policy: "none", "never", "auto-nopay", ...)
are built, warmed up and stepped under cProfile in turn (blocks of --block steps); the table lists, per
function, the own-time difference per step (us, cProfile roughly doubles Python's cost: read
the order and the call counts, not the microseconds) and the calls per step of each engine.

Usage (GPU node, after scripts/gpu_validation.sh set up the site):
    python3 scripts/diff_step_profiles.py --variants none never auto-nopay --batch 8 --steps 300
CPU:  ... --device cpu --dtype float32 --attention-backend TORCH_MLA --enforce-eager
Each later variant is compared with the first one.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats

from vllm.benchmarks.host_stub import stub_forward
from vllm.benchmarks.spec_policy import (
    VARIANTS,
    SpecPolicyCase,
    add_engine_args,
    build_engine,
    engine_kwargs,
)

# "auto-nopay" without re-probes (as scripts/trace_policy_steps.py --interleaved adds it)
NOPROBE = "auto-nopay-noprobe"


def _key(path: str, line: int, func: str) -> str:
    return f"{path.split('/vllm/')[-1] if '/vllm/' in path else path}:{line}({func})"


def profile_steps(cases: dict[str, SpecPolicyCase], steps: int, stub: bool = False,
                  block: int = 25) -> dict[str, dict[str, tuple[int, float]]]:
    """{variant: {function: (calls, own seconds)}} over `steps` engine steps of each case after
    its warm-up (`stub`: the model forward replaced by fixed outputs,
    vllm/benchmarks/host_stub.py). Every engine is built first and they are profiled in turn,
    `block` steps at a time, one profiler each: on a shared node one engine profiled after
    another once came out +348 us per step in every function alike (the machine's state, not
    the engine; eighteenth session), which interleaving spreads over all engines."""
    engines = {}
    try:
        for name, case in cases.items():
            engine = engines[name] = build_engine(case)
            if stub:
                stub_forward(engine.executor.worker.model_runner)
            for _ in range(case.warmup_steps):
                engine.step()
        profilers = {name: cProfile.Profile() for name in engines}
        done = 0
        while done < steps:
            n = min(block, steps - done)
            for name, engine in engines.items():
                profiler = profilers[name]
                profiler.enable()
                for _ in range(n):
                    if not engine.has_unfinished_requests():
                        profiler.disable()
                        raise ValueError(f"{name}: the requests finished before {steps} "
                                         "profiled steps; raise --output-len")
                    engine.step()
                profiler.disable()
            done += n
        out = {}
        for name, profiler in profilers.items():
            rows = {}
            for (path, line, func), (_, calls, own, _, callers) in pstats.Stats(
                    profiler).stats.items():
                key = _key(path, line, func)
                rows[key] = (calls, own)
                # per call site: "function <- caller" (calls, own time spent under that caller)
                for (c_path, c_line, c_func), (_, c_calls, c_own, _) in callers.items():
                    rows[f"{key} <- {_key(c_path, c_line, c_func)}"] = (c_calls, c_own)
            out[name] = rows
        return out
    finally:
        for engine in engines.values():
            engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=["none", "never", "auto-nopay"],
                        choices=VARIANTS + (NOPROBE,))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup-steps", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=None,
                        help="None: warm-up + steps + 64")
    parser.add_argument("--scheduling", choices=("default", "sync"), default="default")
    parser.add_argument("--prompt-stagger", type=int, default=0)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--block", type=int, default=25,
                        help="steps per engine per turn (the engines are profiled in turn)")
    parser.add_argument("--callers", default=None, metavar="TEXT",
                        help="also tabulate, call site by call site, the functions whose name "
                             "contains TEXT (e.g. copy_): which caller's calls differ")
    add_engine_args(parser)
    parser.add_argument("--stub-forward", action="store_true",
                        help="replace the model forward by fixed outputs (host work only; for "
                             "engines that do not draft: none, never, auto-nopay-noprobe after "
                             "its exploration)")
    args = parser.parse_args()
    if len(args.variants) < 2:
        parser.error("--variants needs at least two engines to compare")
    output_len = args.output_len or args.warmup_steps + args.steps + 64
    cases = {}
    for name in args.variants:
        variant, extra = name, {}
        if name == NOPROBE:
            variant = "auto-nopay"
            extra["cost_model_config"] = (("probe_interval", 10 ** 6),
                                          ("max_probe_interval", 10 ** 6))
        case = SpecPolicyCase(variant, args.batch, output_len=output_len,
                              warmup_steps=args.warmup_steps, **engine_kwargs(args),
                              async_scheduling=None if args.scheduling == "default" else False,
                              prompt_stagger=args.prompt_stagger,
                              # all engines are alive at once: 1 GiB of KV cache each on a GPU
                              kv_cache_memory_bytes=(1 << 30) if args.device == "cuda" else None,
                              **extra)
        cases[name] = case
    profiles = profile_steps(cases, args.steps, args.stub_forward, args.block)
    base_name = args.variants[0]
    base = profiles[base_name]
    for name in args.variants[1:]:
        other = profiles[name]
        rows = []
        for key in set(base) | set(other):
            if " <- " in key:
                continue  # call sites: the --callers table
            calls_a, own_a = base.get(key, (0, 0.0))
            calls_b, own_b = other.get(key, (0, 0.0))
            rows.append(((own_b - own_a) / args.steps * 1e6, key, calls_a / args.steps,
                         calls_b / args.steps))
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        print(f"\n#### {name} over {base_name}, B={args.batch}, {args.steps} steps, "
              f"scheduling={args.scheduling}: {total:+.1f} us/step of own time in all")
        print(f"| own us/step {name} - {base_name} | calls/step {base_name} | calls/step {name} "
              "| function |")
        print("|---|---|---|---|")
        for delta, key, calls_a, calls_b in rows[:args.top]:
            print(f"| {delta:+.1f} | {calls_a:.2f} | {calls_b:.2f} | {key} |")
        if args.callers:
            sites = []
            for key in set(base) | set(other):
                if " <- " not in key or args.callers not in key.split(" <- ")[0]:
                    continue
                calls_a, own_a = base.get(key, (0, 0.0))
                calls_b, own_b = other.get(key, (0, 0.0))
                sites.append(((own_b - own_a) / args.steps * 1e6, key, calls_a / args.steps,
                              calls_b / args.steps, own_b / max(calls_b, 1) * 1e6))
            sites.sort(reverse=True)
            print(f"\n| own us/step {name} - {base_name} | calls/step {base_name} | calls/step "
                  f"{name} | us/call {name} | call site ({args.callers!r}) |")
            print("|---|---|---|---|---|")
            for delta, key, calls_a, calls_b, per_call in sites[:args.top]:
                print(f"| {delta:+.1f} | {calls_a:.2f} | {calls_b:.2f} | {per_call:.1f} | {key} |")


if __name__ == "__main__":
    main()
