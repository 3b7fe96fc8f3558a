"""`vllm tiny-model [--output DIR]`: write the built-in tiny target and its drafters."""
from __future__ import annotations

import argparse
import os


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "tiny-model", help="write the built-in tiny model and its EAGLE/MTP/DFlash/DSpark drafters",
        description="Write the built-in tiny DeepSeek-style model (the trained weights shipped in "
                    "the package, see scripts/train_tiny.py) and its drafters to a directory; no "
                    "network and no training needed.")
    parser.add_argument("--output", default=None, metavar="DIR",
                        help="target directory (default: ~/.cache/vllm-dspark/tiny or "
                             "$VLLM_TINY_MODEL_DIR)")
    parser.add_argument("--train-steps", type=int, default=None, metavar="N",
                        help="write the random-weights test family instead of the shipped "
                             "trained one, its drafters distilled N steps (0 = untrained)")
    parser.add_argument("--quantize", choices=["fp8"], default=None,
                        help="also write <output>/target-fp8: the target block-quantised to fp8 "
                             "(128x128 weight_scale_inv, as DeepSeek-V3 ships)")
    parser.add_argument("--force", action="store_true", help="rewrite even if already complete")
    parser.set_defaults(dispatch=run)


def run(args: argparse.Namespace) -> int:
    from vllm.model_executor.models.tiny import write_tiny_models

    if args.output is not None and os.path.exists(args.output) and not os.path.isdir(args.output):
        raise ValueError(f"--output {args.output!r} exists and is not a directory; pick a directory")
    kwargs = {"cache_dir": args.output, "force": args.force}
    if args.train_steps is not None:
        if args.train_steps < 0:
            raise ValueError(f"--train-steps must be >= 0, got {args.train_steps}")
        kwargs["train_steps"] = args.train_steps
    paths = write_tiny_models(**kwargs)
    for name in ("target", "eagle", "mtp", "dflash", "dspark"):
        print(f"{name:>7}: {getattr(paths, name)}")
    if args.quantize == "fp8":
        from vllm.model_executor.model_loader.fp8_writer import write_fp8_checkpoint
        fp8_dir = write_fp8_checkpoint(paths.target, os.path.join(os.path.dirname(paths.target), "target-fp8"))
        print(f"{'fp8':>7}: {fp8_dir}")
    print(f"serve it with: vllm serve {paths.target}")
    return 0
