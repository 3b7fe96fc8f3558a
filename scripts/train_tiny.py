#!/usr/bin/env python
"""Train the built-in tiny DeepSeek-V3 target on text that ships with Python, then distil its
EAGLE / MTP / DFlash / DSpark drafters from the trained target's own continuations, and write the
weights that `write_tiny_models()` ships (vllm/model_executor/models/tiny_weights/*.safetensors).

    nice -n 10 python scripts/train_tiny.py --seed 0            # the shipped run (README)
    python scripts/train_tiny.py --steps 20 --distill-steps 5 --out /tmp/t   # a smoke run

Data (deterministic from --seed on one Python install): English prose from pydoc_data/topics.py
and the source of every top-level stdlib module, except textwrap.py, held out for the loss test.
Each training row is a 129-byte window at a random offset, English or code with equal odds.
Runs on CPU with a plain-torch forward (tiny_train), one thread by default.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

HELD_OUT = "textwrap.py"  # stdlib module never seen in training (tests measure loss on it)


def stdlib_dir() -> str:
    return os.path.dirname(os.__file__)


def load_corpus() -> tuple[bytes, bytes]:
    """(English bytes, code bytes); sorted file and topic order so the bytes are reproducible."""
    import pydoc_data.topics as topics

    english = "\n\n".join(topics.topics[k] for k in sorted(topics.topics)).encode("utf-8")
    files = [f for f in sorted(glob.glob(os.path.join(stdlib_dir(), "*.py"))) if os.path.basename(f) != HELD_OUT]
    code = b"\n\n".join(open(f, "rb").read() for f in files)
    return english, code


def sample_batch(sources: list[torch.Tensor], batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    which = torch.randint(0, len(sources), (batch,), generator=gen).tolist()
    rows = []
    for w in which:
        src = sources[w]
        start = int(torch.randint(0, len(src) - length, (1,), generator=gen))
        rows.append(src[start:start + length])
    return torch.stack(rows).long()


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def held_out_loss(p, cfg, tables, window: int = 128, max_bytes: int = 8192) -> float:
    """Mean next-byte loss (nats) over non-overlapping windows of the held-out stdlib file."""
    from vllm.model_executor.models import tiny_train as tt

    data = torch.tensor(list(open(os.path.join(stdlib_dir(), HELD_OUT), "rb").read()[:max_bytes]))
    n = (len(data) - 1) // window
    x = torch.stack([data[i * window:(i + 1) * window + 1] for i in range(n)])
    with torch.no_grad():
        h, _ = tt.target_forward(p, cfg, x[:, :-1], tables)
        return float(F.cross_entropy(tt.lm_logits(p, h).flatten(0, 1), x[:, 1:].flatten()))


def train_target(args, cfg) -> tuple[dict, dict]:
    from tqdm import tqdm

    from vllm.model_executor.models import tiny, tiny_train as tt

    tt.check_supported(cfg)
    english, code = load_corpus()
    sources = [torch.frombuffer(bytearray(english), dtype=torch.uint8),
               torch.frombuffer(bytearray(code), dtype=torch.uint8)]
    gen = torch.Generator().manual_seed(args.seed)
    p = tt.init_std_weights(tiny.target_tensor_shapes(cfg), args.seed)
    biases = [k for k in p if k.endswith("e_score_correction_bias")]  # balanced, not learned
    trained = {k: v.requires_grad_(True) for k, v in p.items() if k not in biases}
    decay = [v for k, v in trained.items() if v.dim() == 2]
    no_decay = [v for k, v in trained.items() if v.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    tables = tt.rope_tables(cfg, args.seq_len + 8)
    losses, start = [], time.time()
    bar = tqdm(range(args.steps), desc="training tiny target", unit="step")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, max(1, args.steps // 25))
        x = sample_batch(sources, args.batch, args.seq_len + 1, gen)
        load: list = []
        h, _ = tt.target_forward(p, cfg, x[:, :-1], tables, load=load)
        loss = F.cross_entropy(tt.lm_logits(p, h).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(trained.values()), 1.0)
        opt.step()
        with torch.no_grad():  # DeepSeek's auxiliary-loss-free balancing: nudge the routing bias
            for name, counts in zip(biases, load):
                c = torch.tensor(counts, dtype=torch.float32)
                p[name] += 1e-3 * torch.sign(c.mean() - c)
        losses.append(float(loss))
        if step % 10 == 0:
            bar.set_postfix(loss=f"{sum(losses[-50:]) / len(losses[-50:]):.3f}")
    final = {k: v.detach().to(torch.float16).float() for k, v in p.items()}  # as shipped
    info = {"steps": args.steps, "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr,
            "train_wall_s": round(time.time() - start, 1),
            "final_train_loss": round(sum(losses[-100:]) / len(losses[-100:]), 4),
            "held_out_loss": round(held_out_loss(final, cfg, tables), 4)}
    return final, info


def distil(args, configs, target_p) -> tuple[dict, dict]:
    from vllm.model_executor.models import tiny, tiny_distill, tiny_train as tt

    english, code = load_corpus()
    gen = torch.Generator().manual_seed(args.seed + 7)
    sources = [torch.frombuffer(bytearray(english), dtype=torch.uint8),
               torch.frombuffer(bytearray(code), dtype=torch.uint8)]
    prompts = sample_batch(sources, args.distill_seqs, args.prompt_len, gen)
    weights = {"target": target_p}
    for k, name in enumerate(tiny_distill.DRAFTERS):
        cfg, shapes = configs[name]
        # every drafter's init is drawn (a subset run then starts where the full run starts)
        weights[name] = tt.init_std_weights(shapes(cfg), args.seed + 1 + k)
        if args.resume and name in args.drafters:  # continued: from the drafter in --out
            from safetensors.torch import load_file

            path = os.path.join(args.out or tiny.shipped_weights_dir(), f"{name}.safetensors")
            weights[name] = {k: v.float() for k, v in load_file(path).items()}
    report: dict = {}
    start = time.time()
    steps = {"eagle": args.distill_steps, "mtp": args.distill_steps, "dflash": args.distill_steps,
             "dspark": args.dspark_steps}
    out = tiny_distill.distill_drafters(configs, weights, train_steps=steps, seed=args.seed,
                                        report=report, prompts=prompts, num_new=args.gen_len, progress=True,
                                        methods=tuple(args.drafters), batch=args.distill_batch,
                                        row_decay=args.row_decay)
    report["distill_wall_s"] = round(time.time() - start, 1)
    return out, report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1200, help="target optimiser steps")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--distill-steps", type=int, default=120, help="optimiser steps per drafter")
    parser.add_argument("--dspark-steps", type=int, default=240, help="optimiser steps of DSpark")
    parser.add_argument("--distill-seqs", type=int, default=256, help="target continuations to distil on")
    parser.add_argument("--distill-batch", type=int, default=16, help="sequences per drafter optimiser step")
    parser.add_argument("--drafters", nargs="+", default=["eagle", "mtp", "dflash", "dspark"],
                        choices=["eagle", "mtp", "dflash", "dspark"],
                        help="drafters to distil; the others keep their weights (and log entries) in --out")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--gen-len", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-target", action="store_true",
                        help="reuse target.safetensors from --out and only distil the drafters")
    parser.add_argument("--out", default=None, help="output dir (default: the package's tiny_weights/)")
    parser.add_argument("--resume", action="store_true",
                        help="start the distilled drafters from their weights in --out, not from a "
                             "random init (a worse result keeps them: distill_drafters' check)")
    parser.add_argument("--dspark-layers", type=int, default=None, metavar="N",
                        help="an experiment: DSpark with N layers (default: the shipped config's); "
                             "read it back with drafter_acceptance.py --num-layers N")
    parser.add_argument("--row-decay", type=float, default=None, metavar="GAMMA",
                        help="DFlash/DSpark loss: block row j weighs exp(-j / GAMMA) (default: "
                             "every row the same)")
    args = parser.parse_args(argv)
    if args.dspark_layers is not None and args.dspark_layers < 1:
        raise SystemExit(f"--dspark-layers must be >= 1, got {args.dspark_layers}")
    if args.row_decay is not None and args.row_decay <= 0:
        raise SystemExit(f"--row-decay must be > 0, got {args.row_decay}")
    for field in ("steps", "batch", "seq_len", "distill_steps", "dspark_steps", "distill_seqs", "distill_batch",
                  "prompt_len", "gen_len", "threads"):
        if getattr(args, field) < 1:
            raise SystemExit(f"--{field.replace('_', '-')} must be >= 1, got {getattr(args, field)}")

    from safetensors.torch import load_file, save_file

    from vllm.model_executor.models import tiny

    torch.set_num_threads(args.threads)
    out_dir = args.out or tiny.shipped_weights_dir()
    if args.resume:
        paths = [os.path.join(out_dir, f"{n}.safetensors") for n in args.drafters]
        missing = [path for path in paths if not os.path.isfile(path)]
        if missing:
            raise SystemExit(f"--resume continues from {', '.join(missing)}, which do not exist: "
                             "drop --resume or point --out at a copy of tiny_weights/")
    os.makedirs(out_dir, exist_ok=True)
    configs = tiny.tiny_family_configs()
    if args.dspark_layers is not None:  # an experiment: the package's config stays as it is
        if args.out is None or args.drafters != ["dspark"]:
            raise SystemExit("--dspark-layers changes the DSpark config: distil it alone "
                             "(--drafters dspark) into an --out copy, not the package")
        cfg, shapes = configs["dspark"]
        configs["dspark"] = ({**cfg, "num_hidden_layers": args.dspark_layers}, shapes)
    target_cfg = configs["target"][0]
    log_path = os.path.join(out_dir, "train_log.json")
    log = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "seed": args.seed,
           "python": sys.version.split()[0], "torch": torch.__version__,
           "data": f"pydoc_data/topics.py + stdlib *.py except {HELD_OUT}"}
    previous = json.load(open(log_path)) if os.path.isfile(log_path) else {}
    keep = [n for n in ("eagle", "mtp", "dflash", "dspark") if n not in args.drafters]
    if keep and not args.skip_target:
        raise SystemExit(f"--drafters {' '.join(args.drafters)} keeps {', '.join(keep)} from {out_dir}, "
                         "whose target it was distilled from: add --skip-target (or distil every drafter)")
    missing = [n for n in keep if not os.path.isfile(os.path.join(out_dir, f"{n}.safetensors"))]
    if missing:
        raise SystemExit(f"--drafters keeps {', '.join(missing)}, but {out_dir} has no "
                         f"{', '.join(m + '.safetensors' for m in missing)}: distil them too")
    if args.skip_target:
        target_p = {k: v.float() for k, v in load_file(os.path.join(out_dir, "target.safetensors")).items()}
        if previous:
            log["target"] = previous["target"]
            log["target_command"] = previous.get("target_command", previous["command"])
    else:
        target_p, log["target"] = train_target(args, target_cfg)
        save_file({k: v.to(torch.float16) for k, v in target_p.items()}, os.path.join(out_dir, "target.safetensors"))
        with open(log_path, "w", encoding="utf-8") as f:  # kept for a later --skip-target run
            json.dump(log, f, indent=2)
        print(json.dumps(log["target"]))
    weights, log["drafters"] = distil(args, configs, target_p)
    for name in keep:  # not distilled here: their weights stay, and so does what made them
        log["drafters"][name] = dict(previous.get("drafters", {}).get(name, {}),
                                     command=previous.get("drafters", {}).get(name, {}).get(
                                         "command", previous.get("command")))
    for name in args.drafters:
        save_file({k: v.to(torch.float16) for k, v in weights[name].items()},
                  os.path.join(out_dir, f"{name}.safetensors"))
    with open(log_path, "w", encoding="utf-8") as f:
        json.dump(log, f, indent=2)
    print(json.dumps(log, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
