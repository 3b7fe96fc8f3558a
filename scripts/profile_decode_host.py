"""Where the host time of a steady decode step goes (cProfile over engine steps).

Usage (GPU node): python scripts/profile_decode_host.py --model benchmarks/configs/deepseek_v3_tp8_rank \
    --load-format dummy --batch 1 --steps 50 [--speculative-config '{"method": "dspark", ...}']
Prints the functions with the largest cumulative time per step (host wall time, the GPU runs
asynchronously underneath), so the next host-overhead cut is chosen from a measurement.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--speculative-config", default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine
    kwargs = {} if args.load_format == "auto" else {"load_format": args.load_format}
    spec = json.loads(args.speculative_config) if args.speculative_config else None
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=args.model, dtype="bfloat16", max_model_len=args.context + 8 * args.steps + 64,
        max_num_seqs=max(args.batch, 1), speculative_config=spec, **kwargs))
    params = SamplingParams(temperature=0.0, max_tokens=6 * args.steps, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [(7 * i + 3 * j + 1) % 250 for j in range(args.context)],
                           params)
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(5):
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler)
    print(f"per step, {args.steps} steps (cumulative seconds / steps * 1e3 = ms):")
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[: args.top]
    for (path, line, name), (_, _, _, cumtime, _) in rows:
        print(f"{cumtime / args.steps * 1e3:8.3f} ms  {path.split('/vllm/')[-1]}:{line}({name})")
    engine.shutdown()


if __name__ == "__main__":
    main()
