"""A/B of the block drafters' early draft step (early_draft.py) in one process: a DSpark engine
drafting every step with the early path off ("0"), on ("auto-fixed", its plans lowered on the
host after the wait), on with the plans lowered on the device and the draft step launched before
the wait ("lowered": device lowering on for that engine alone, whatever the environment says)
and as the default "auto" decides ("tuned": its measured A/B, EarlyDraftTuner, with
VLLM_EARLY_DRAFT_DEVICE_LOWERING as set, default on), and a plain engine, all
alive at once and stepped in turn in 16-step blocks (vllm.benchmarks.spec_policy.run_interleaved;
the GPU node's process-to-process noise is larger than the effect).

Usage (GPU node): python3 scripts/probe_early_draft.py --batch-sizes 1 8 [--output-len 384]
V3-rank dims (random weights; the random drafter accepts nothing, so none / late is issue #10's
overhead factor):
       python3 scripts/probe_early_draft.py --model benchmarks/configs/deepseek_v3_tp8_rank \
           --draft-model benchmarks/configs/deepseek_v3_tp8_rank_dspark --load-format dummy \
           --batch-sizes 1 32 --output-len 160
Prints per batch size: tok/s of each engine, early / late and each over plain, and how many
early steps were lowered in place on the host (FlashInfer), built again, or launched before the
wait, and of those how many advanced the previous step's plans instead of building; greedy tokens
are compared (equal acceptance lengths mean equal drafts).
"""
from __future__ import annotations

import argparse
import dataclasses

from vllm.benchmarks.spec_policy import SpecPolicyCase, run_interleaved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--output-len", type=int, default=384)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention-backend", default="FLASHINFER_MLA")
    parser.add_argument("--model", default=None, help="None: the built-in tiny model")
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--context", type=int, default=None,
                        help="prompt tokens (None: 64 for the tiny model, else 1024)")
    parser.add_argument("--num-spec-tokens", type=int, default=4)
    args = parser.parse_args()
    print("B  engine        tok/s   x none  x late  early refreshed/rebuilt/launched/advanced"
          "  greedy vs late/none  AL")
    for batch in args.batch_sizes:
        base = SpecPolicyCase(variant="always", batch=batch, output_len=args.output_len,
                              device=args.device, dtype=args.dtype,
                              attention_backend=args.attention_backend, async_scheduling=False,
                              model=args.model, draft_model=args.draft_model,
                              load_format=args.load_format, context=args.context,
                              num_spec_tokens=args.num_spec_tokens)
        cases = {"none": dataclasses.replace(base, variant="none", async_scheduling=None),
                 "late": dataclasses.replace(base, early_draft="0"),
                 "early": dataclasses.replace(base, early_draft="auto-fixed"),
                 "lowered": dataclasses.replace(base, early_draft="auto-fixed"),
                 "tuned": dataclasses.replace(base, early_draft="auto")}
        speculators = {}

        def on_warm(name, engine):
            spec = speculators[name] = engine.executor.worker.model_runner.speculator
            if spec is not None and name in ("early", "lowered"):
                # "early": host lowering after the wait; "lowered": on the device before it,
                # and the draft step launched right after (the flag's two settings, one
                # process)
                spec.device_lowering = name == "lowered"

        result = run_interleaved(cases, on_warm=on_warm)
        none = result["none"]["tok_s"]
        for name in cases:
            r = result[name]
            spec = speculators.get(name)
            counts = ("-" if spec is None
                      else f"{spec.early_refreshes}/{spec.early_rebuilds}/"
                           f"{spec.early_launches}/{spec.early_reuses}")
            same = ("-" if name == "none" else
                    ("same" if r["tokens"] == result["late"]["tokens"] else "DIFF")
                    + "/" + ("same" if r["tokens"] == result["none"]["tokens"] else "DIFF"))
            print(f"{batch:<2} {name:<10} {r['tok_s']:>9.1f} {r['tok_s'] / none:>7.3f} "
                  f"{r['tok_s'] / result['late']['tok_s']:>7.3f}  {counts:>31}  {same:>14}  "
                  f"{r.get('mean_acceptance_length') or '-':.4}", flush=True)
        tuner = getattr(speculators.get("tuned"), "early_tuner", None)
        print(f"   ({result['_rounds']} rounds of 16-step blocks; tuned engine's trials "
              f"(bucket, late s, early s, early?): {getattr(tuner, 'history', None)})",
              flush=True)


if __name__ == "__main__":
    main()
