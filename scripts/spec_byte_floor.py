"""Byte floor of a block drafter's overhead factor (vllm/benchmarks/byte_floor.py says what is
counted). Builds the target and the drafter on the CPU from their config.json (uninitialised
weights, nothing loaded) and prints, per batch size and context, the bytes a plain and a
speculative decode step must move and their ratio: the lowest overhead factor t_spec / t_plain
a memory-bound step can reach.

  python3 scripts/spec_byte_floor.py --model benchmarks/configs/deepseek_v3_tp8_rank \
      --draft-model benchmarks/configs/deepseek_v3_tp8_rank_dspark --batch-sizes 1 32
"""
from __future__ import annotations

import argparse
import json

from vllm.benchmarks.byte_floor import build_models, step_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--draft-model", required=True)
    parser.add_argument("--method", default="dspark", choices=("dspark", "dflash"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    target, drafter = build_models(args.model, args.draft_model, args.method, args.dtype)
    rows = []
    print(f"{'B':>4} {'ctx':>6} {'plain MB':>9} {'spec MB':>9} {'floor':>6}")
    for batch in args.batch_sizes:
        for context in args.contexts:
            b = step_bytes(target, drafter, batch, context)
            rows.append({"batch": batch, "context": context, "plain_bytes": b.plain,
                         "speculative_bytes": b.speculative, "overhead_floor": b.overhead_floor,
                         "draft_parts": b.breakdown})
            print(f"{batch:>4} {context:>6} {b.plain / 1e6:9.1f} {b.speculative / 1e6:9.1f} "
                  f"{b.overhead_floor:6.3f}")
    print("draft-side weights read per speculative step (MB): "
          + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in rows[0]["draft_parts"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
