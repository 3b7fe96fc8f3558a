"""Decode step of the DeepSeek-V3 per-TP8-rank benchmark config (benchmarks/configs) with bf16 vs
block-FP8 weights (dummy weights, one GPU), side by side in one process, plus the weight bytes.

Each engine is the steady-decode measurement of benchmarks/engine/benchmark_decode.py (`run_case`:
async scheduling, CUDA graphs, greedy): median step between returns, block-mean step, and the
profiler's GPU kernel time per step. bf16 and fp8 engines alternate in rounds whose order flips
every other round, the first round is dropped, and every fp8/bf16 ratio is the geometric mean
of per-round ratios (vllm/benchmarks/rounds.py). Separate processes per quantisation gave
opposite wall-clock verdicts on 2026-12-01, following which process ran first on the machine.

Usage (GPU node):  python benchmarks/benchmark_fp8_decode.py [--batch-sizes 1 32] [--rounds 4]
                   [--steps 60] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from pathlib import Path
from types import SimpleNamespace

from vllm.benchmarks.rounds import alternating_rounds, paired_ratio

HERE = Path(__file__).parent
DEFAULT_MODEL = str(HERE / "configs" / "deepseek_v3_tp8_rank")


def _decode_benchmark():
    """benchmarks/engine/benchmark_decode.py as a module (its run_case and copy_bandwidth)."""
    spec = importlib.util.spec_from_file_location("benchmark_decode",
                                                  HERE / "engine" / "benchmark_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--attention-backend", default="FLASHINFER_MLA")
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--steps-per-block", type=int, default=20)
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4,
                        help="kept rounds (each runs a bf16 and an fp8 engine)")
    parser.add_argument("--warmup-rounds", type=int, default=1,
                        help="rounds run first and dropped (the first engines of a process pay "
                             "one-time costs)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_fp8_decode needs a CUDA GPU")
    bench = _decode_benchmark()
    bandwidth = bench.copy_bandwidth()

    def engine_args(quantization):
        return SimpleNamespace(
            model=args.model, draft_model=None, load_format="dummy",
            attention_backend=args.attention_backend, quantization=quantization,
            num_spec_tokens=0, warmup_steps=args.warmup_steps, steps=args.steps,
            steps_per_block=args.steps_per_block, profile_steps=args.profile_steps,
            bandwidth=bandwidth)

    results = []
    for batch in args.batch_sizes:
        runs = alternating_rounds(
            {"bf16": None, "fp8": "fp8"}, args.rounds,
            lambda quantization: bench.run_case(engine_args(quantization), "none", batch,
                                                args.context, eager=False,
                                                async_scheduling=True),
            warmup_rounds=args.warmup_rounds)
        bf, f8 = runs["bf16"], runs["fp8"]
        out = {"batch": batch, "context": args.context,
               "weight_GB": {"bf16": bf[0]["weight_GB"], "fp8": f8[0]["weight_GB"]}}
        for key in ("kernel_ms", "step_ms_median_single", "step_ms"):
            ratio, ratios = paired_ratio([r[key] for r in f8], [r[key] for r in bf])
            out[key] = {"bf16": [r[key] for r in bf], "fp8": [r[key] for r in f8],
                        "fp8_over_bf16": ratio, "rounds": ratios}
        results.append(out)
        print(json.dumps(out), flush=True)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; fp8 / bf16 per decode step (geometric "
          f"mean of {args.rounds} paired rounds; < 1 = fp8 faster)")
    print(f"{'B':>4} {'weights':>8} {'kernel':>8} {'median step':>12} {'block step':>11} "
          f"{'bf16 kern ms':>12} {'fp8 kern ms':>11} {'bf16 step ms':>12} {'fp8 step ms':>11}")
    for r in results:
        med = statistics.median
        print(f"{r['batch']:>4} {r['weight_GB']['fp8'] / r['weight_GB']['bf16']:8.3f} "
              f"{r['kernel_ms']['fp8_over_bf16']:8.3f} "
              f"{r['step_ms_median_single']['fp8_over_bf16']:12.3f} "
              f"{r['step_ms']['fp8_over_bf16']:11.3f} {med(r['kernel_ms']['bf16']):12.3f} "
              f"{med(r['kernel_ms']['fp8']):11.3f} "
              f"{med(r['step_ms_median_single']['bf16']):12.3f} "
              f"{med(r['step_ms_median_single']['fp8']):11.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
