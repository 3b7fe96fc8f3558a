#!/usr/bin/env python
"""Offline acceptance of tiny DSpark drafters (vllm/benchmarks/drafter_acceptance.py), CPU only,
seconds per drafter: per request, the mean accepted length over every anchor and the tokens per
step of the greedy walk an engine takes, and the tok/s ceilings at equal step cost.

    python scripts/drafter_acceptance.py                         # the shipped drafter
    python scripts/drafter_acceptance.py --drafters /tmp/a /tmp/b   # dirs with dspark.safetensors
                                                                 # or model.safetensors
Prompt sets: "bench" (benchmark_spec_policy.py's, context 64, 256 tokens) and "textwrap"
(windows of the held-out stdlib module).
"""
from __future__ import annotations

import argparse
import json
import os

import torch


def _load_drafter(path: str) -> dict:
    from safetensors.torch import load_file

    for name in ("dspark.safetensors", "model.safetensors"):
        if os.path.isfile(os.path.join(path, name)):
            return {k: v.float() for k, v in load_file(os.path.join(path, name)).items()}
    raise SystemExit(f"--drafters {path}: no dspark.safetensors or model.safetensors there")


def main(argv=None) -> int:
    from vllm.benchmarks import drafter_acceptance as da
    from vllm.model_executor.models import tiny

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafters", nargs="+", default=[tiny.shipped_weights_dir()])
    parser.add_argument("--block-size", type=int, default=None,
                        help="the drafter's block (default: the shipped config's)")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="the drafter's layers (default: the shipped config's; "
                             "train_tiny.py --dspark-layers)")
    parser.add_argument("--prompt-sets", nargs="+", default=["bench", "textwrap"],
                        choices=["bench", "textwrap"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    configs = tiny.tiny_family_configs()
    target_cfg, draft_cfg = configs["target"][0], dict(configs["dspark"][0])
    if args.block_size is not None:
        draft_cfg["block_size"] = args.block_size
    if args.num_layers is not None:
        if args.num_layers < 1:
            raise SystemExit(f"--num-layers must be >= 1, got {args.num_layers}")
        draft_cfg["num_hidden_layers"] = args.num_layers
    if args.output_len <= draft_cfg["block_size"] + 1:
        raise SystemExit(f"--output-len {args.output_len} must exceed block size + 1")
    target_p = tiny.load_shipped_weights(configs)["target"]
    prompts = {"bench": da.benchmark_prompts, "textwrap": da.textwrap_prompts}
    rows = []
    print("| drafter | prompts | every anchor | engine walk: tok/step (min..max) | "
          "ceiling B=1 | ceiling B=%d |" % args.batch)
    print("|---|---|---|---|---|---|")
    want = tiny.dspark_tensor_shapes(draft_cfg)
    for path in args.drafters:
        draft_p = _load_drafter(path)
        bad = sorted(set(want) ^ set(draft_p)) + [
            k for k in want if k in draft_p and tuple(draft_p[k].shape) != want[k]]
        if bad:  # another layer count (or config) than the one asked for: no silent subset
            raise SystemExit(
                f"--drafters {path}: its tensors do not fit a DSpark of "
                f"{draft_cfg['num_hidden_layers']} layers (first mismatches: {bad[:3]}); "
                "pass the --num-layers it was distilled with (train_tiny.py --dspark-layers)")
        for name in args.prompt_sets:
            s = da.dspark_acceptance(target_p, target_cfg, draft_p, draft_cfg,
                                     prompts[name](args.batch, args.context), args.output_len)
            ceil = s.equal_cost_ceilings()
            walk = s.tokens_per_step
            print(f"| {path} | {name} | {sum(s.per_anchor) / len(s.per_anchor):.2f} | "
                  f"{sum(walk) / len(walk):.2f} ({min(walk):.2f}..{max(walk):.2f}) | "
                  f"{ceil['B=1']:.2f} | {ceil[f'B={args.batch}']:.2f} |")
            rows.append({"drafter": path, "prompts": name, "per_anchor": s.per_anchor,
                         "tokens_per_step": walk, "steps": s.steps, "ceilings": ceil})
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
