"""Every GPU kernel of a steady engine step, by name: how many a step launches and their time,
the CUDA runtime calls the host made per step (launches, graph launches, copies, event waits)
and how long the host waited on the GPU in that step (GPU only).

Why: a synchronous DSpark step's critical path is its host work before the verify launch, then
the longer of the verify step's GPU time and the early draft preparation on the host, then the
host work after the wait. Where the host is fast, the verify graph's GPU time (~0.33 ms of ~165
small kernels on the tiny model, sixteenth session) is a third of the step; which of its
kernels could go is what this lists. The wait column says whether this host is in that regime.

Usage (GPU node, after `source .gpu/env.sh`):
    python3 scripts/graph_kernels.py --variants none always --batch 1 --steps 40
"""
from __future__ import annotations

import argparse
import re
from collections import defaultdict

import torch

from vllm.benchmarks.spec_policy import SpecPolicyCase, build_engine

# Host calls that block on the GPU (the runner's one event wait per step among them).
_WAITS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize")


def _short(name: str, width: int) -> str:
    name = re.sub(r"\s+", " ", name)
    return name if len(name) <= width else name[:width - 3] + "..."


def profile_variant(case: SpecPolicyCase, warmup: int, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile
    engine = build_engine(case)
    try:
        for _ in range(warmup):
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        if not engine.has_unfinished_requests():
            raise RuntimeError("the requests finished inside the profiled steps: raise "
                               "--output-len")
    finally:
        engine.shutdown()
    count: dict[str, int] = defaultdict(int)
    time_us: dict[str, float] = defaultdict(float)
    wait_us = 0.0
    runtime: dict[str, int] = defaultdict(int)  # CUDA runtime / driver calls by the host
    for e in prof.events():
        span = e.time_range.end - e.time_range.start
        if e.device_type == torch.autograd.DeviceType.CUDA:
            count[e.name] += 1
            time_us[e.name] += span
        else:
            if e.name in _WAITS:
                wait_us += span
            if e.name.startswith(("cuda", "cu")) and not e.name.startswith("cudaGetDevice"):
                runtime[e.name] += 1
    return {"count": count, "time_us": time_us, "wait_us": wait_us, "steps": steps,
            "runtime": runtime}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=["none", "always"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=48)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--output-len", type=int, default=768)
    parser.add_argument("--top", type=int, default=60)
    parser.add_argument("--width", type=int, default=90)
    parser.add_argument("--scheduling", choices=["default", "sync"], default="sync",
                        help="sync (default): every engine synchronous, so a step's wait is "
                        "its own")
    args = parser.parse_args()
    results = {}
    for variant in args.variants:
        case = SpecPolicyCase(variant, args.batch, output_len=args.output_len,
                              async_scheduling=False if args.scheduling == "sync" else None)
        results[variant] = profile_variant(case, args.warmup, args.steps)
    names = sorted({n for r in results.values() for n in r["time_us"]},
                   key=lambda n: -max(r["time_us"].get(n, 0.0) / r["steps"]
                                      for r in results.values()))
    head = " | ".join(f"{v} n/step | {v} us/step" for v in results)
    print(f"| kernel | {head} |")
    print("|---|" + "---|---|" * len(results))
    for name in names[:args.top]:
        cells = " | ".join(f"{r['count'].get(name, 0) / r['steps']:.2f} | "
                           f"{r['time_us'].get(name, 0.0) / r['steps']:.1f}"
                           for r in results.values())
        print(f"| {_short(name, args.width)} | {cells} |")
    print()
    calls = sorted({n for r in results.values() for n in r["runtime"]})
    print("| host runtime call | " + " | ".join(f"{v} / step" for v in results) + " |")
    print("|---|" + "---|" * len(results))
    for name in calls:
        print(f"| {name} | " + " | ".join(f"{r['runtime'].get(name, 0) / r['steps']:.2f}"
                                           for r in results.values()) + " |")
    print()
    print("| variant | kernels / step | kernel us / step | host wait on the GPU us / step |")
    print("|---|---|---|---|")
    for variant, r in results.items():
        n = r["steps"]
        print(f"| {variant} B={args.batch} | {sum(r['count'].values()) / n:.1f} | "
              f"{sum(r['time_us'].values()) / n:.1f} | {r['wait_us'] / n:.1f} |")


if __name__ == "__main__":
    main()
