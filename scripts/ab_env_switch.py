"""In-process A/B of an on/off environment switch (`VLLM_...=0` / `=1`) on the speculation
policy cases (vllm.benchmarks.spec_policy; default: none and DSpark "always"): every round runs
each case once with the switch off and once on, in alternating order, each engine built after
the switch is set (a switch read when an engine is built or at its first use applies to it),
since one engine's tok/s moves by up to 2x between processes on the GPU node. Prints, per batch
size and setting, the median tok/s and the median of the rounds' variant / baseline ratios.

Usage (GPU node): python scripts/ab_env_switch.py --switch VLLM_FUSED_DRAFT_PLAN_LOWERING
    --batch-sizes 1 --rounds 5
CPU smoke run: ... --device cpu --dtype float32 --attention-backend TORCH_MLA --enforce-eager
"""
from __future__ import annotations

import argparse
import json
import os

from vllm.benchmarks.rounds import setting_rows, setting_table
from vllm.benchmarks.spec_policy import (VARIANTS, SpecPolicyCase, add_engine_args,
                                         engine_kwargs, run_case)


def run(args) -> dict:
    tok_s: dict[tuple, list[float]] = {}
    saved = os.environ.get(args.switch)
    try:
        for rnd in range(args.warmup_rounds + args.rounds):
            order = ("0", "1") if rnd % 2 == 0 else ("1", "0")
            for setting in order:
                os.environ[args.switch] = setting
                for batch in args.batch_sizes:
                    for variant in args.variants:
                        case = SpecPolicyCase(variant, batch, output_len=args.output_len,
                                              warmup_steps=args.warmup_steps,
                                              **engine_kwargs(args))
                        result = run_case(case)["tok_s"]
                        if rnd >= args.warmup_rounds:
                            tok_s.setdefault((setting, batch, variant), []).append(result)
    finally:
        if saved is None:
            os.environ.pop(args.switch, None)
        else:
            os.environ[args.switch] = saved
    rows = setting_rows(tok_s, ["0", "1"], args.batch_sizes, args.variants)
    return {"switch": args.switch, "rows": rows,
            "tok_s": {f"{k[0]}:{k[1]}:{k[2]}": v for k, v in tok_s.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--switch", required=True,
                        help="the environment variable set to 0 and 1 in turn")
    parser.add_argument("--variants", nargs="+", default=["none", "always"], choices=VARIANTS,
                        help="the first is the baseline of the ratios")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup-rounds", type=int, default=1)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--warmup-steps", type=int, default=32)
    add_engine_args(parser)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not args.switch.startswith("VLLM_"):
        parser.error(f"--switch {args.switch!r}: name one of the engine's VLLM_ switches")
    if len(args.variants) < 2:
        parser.error("--variants needs a baseline and at least one more variant")
    result = run(args)
    print(setting_table(result["rows"], args.switch, args.variants))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
