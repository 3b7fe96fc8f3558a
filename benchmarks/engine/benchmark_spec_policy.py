"""Speculation policy benchmark: does speculation that cannot pay cost nothing once the policy
has switched it off? (issue 15, "Speculation policy").

For each batch size it runs the same greedy decode through the real engine (LLMEngine.step) and
reports steady-state output tok/s of:
  none          no speculation (the baseline)
  always        DSpark drafting every step (speculative_config without a policy)
  never         disable_by_batch_size=1 (upstream's switch at its extreme: nobody drafts)
  auto          disable_by_batch_size="auto", the cost model on measured step times and the
                drafter's real acceptance
  auto-nopay    "auto" with the cost model's acceptance forced to --forced-acceptance (1.0: every
                draft counted as rejected) on measured step times: drafting cannot pay, so the
                engine must stop drafting and come back to within 5% of `none`
and, next to each, its ratio to `none`, the drafted / skipped decisions and the cost model's
measured step times. Greedy tokens of every variant are compared with `none`'s (they must match).

Usage (GPU, after the decode-speed work):
  python benchmarks/engine/benchmark_spec_policy.py --batch-sizes 1 8
  (CPU smoke run: --device cpu --dtype float32 --attention-backend TORCH_MLA --enforce-eager)
"""
from __future__ import annotations

import argparse
import json
import os

from vllm.benchmarks.spec_policy import (
    VARIANTS,
    SpecPolicyCase,
    add_engine_args,
    engine_kwargs,
    paired_ratio,
    run_rounds,
)
from vllm.benchmarks.rounds import round_spread

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model dir (default: built-in tiny)")
    parser.add_argument("--draft-model", default=None, help="drafter dir (default: built-in)")
    parser.add_argument("--method", default="dspark")
    parser.add_argument("--num-spec-tokens", type=int, default=4)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=None,
                        help="prompt tokens per request (default 64 for the built-in tiny model, "
                             "trained on 129-byte windows; 1024 otherwise)")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--warmup-steps", type=int, default=32,
                        help="untimed engine steps (prefill, cost-model exploration)")
    parser.add_argument("--forced-acceptance", type=float, default=1.0,
                        help="acceptance length the auto-nopay cost model assumes")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--repeats", type=int, default=4,
                        help="rounds; each runs every variant once, in alternating order, and "
                             "ratios to 'none' pair runs of the same round (geometric mean)")
    parser.add_argument("--warmup-rounds", type=int, default=1,
                        help="rounds run first and dropped (one-time costs of the first engines)")
    add_engine_args(parser)
    parser.add_argument("--scheduling", choices=("default", "sync"), default="default",
                        help="default: every engine schedules as the engine does by default "
                             "(plain decoding and DFlash/DSpark under a policy async, drafting "
                             "on every step synchronous): the tok/s a user gets. sync: every "
                             "engine synchronous, which isolates the drafting policy from the "
                             "scheduling")
    parser.add_argument("--out", default="out/spec_policy")
    args = parser.parse_args()
    if "none" not in args.variants:
        parser.error("--variants must include 'none' (the baseline every ratio is taken to)")
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for batch in args.batch_sizes:
        cases = {variant: SpecPolicyCase(
            variant, batch, context=args.context, output_len=args.output_len,
            warmup_steps=args.warmup_steps, method=args.method,
            num_spec_tokens=args.num_spec_tokens, model=args.model,
            draft_model=args.draft_model, forced_acceptance=args.forced_acceptance,
            **engine_kwargs(args),
            async_scheduling=None if args.scheduling == "default" else False)
            for variant in ["none"] + [v for v in args.variants if v != "none"]}
        runs = run_rounds(cases, args.repeats, warmup_rounds=args.warmup_rounds)
        for variant, variant_runs in runs.items():
            ranked = sorted(variant_runs, key=lambda r: r["tok_s"])
            row = dict(ranked[(len(ranked) - 1) // 2])  # the median run (lower middle)
            row["tok_s_runs"] = [r["tok_s"] for r in variant_runs]
            # collections are rare events: the mean over the runs, not the median run's
            row["gc_ms_per_step"] = sum(r.get("gc_ms_per_step", 0.0)
                                        for r in variant_runs) / len(variant_runs)
            # tokens per engine step of the timed steps: with every step costing the same,
            # tok/s would be this over no speculation's. A batch that finishes its requests in
            # different steps (speculation) runs its last steps part-empty, which this counts.
            row["tokens_per_step"] = row["timed_tokens"] / row["timed_steps"]
            row["x_none"], row["x_none_rounds"] = paired_ratio(variant_runs, runs["none"])
            row["all_runs_tokens_equal"] = all(r["tokens"] == runs["none"][0]["tokens"]
                                               for r in variant_runs)
            # runs whose timed steps began inside the early draft tuner's trial
            row["runs_timed_in_tuner_trial"] = sum(
                r.get("early_draft_at_timing") == "trial" for r in variant_runs)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
    base = {r["batch"]: r for r in rows if r["variant"] == "none"}
    # tok/s: the median run; x none: geometric mean of the per-round paired ratios
    # tok/step x: tokens per step over no speculation's, the tok/s ratio at equal step cost
    # (x none = tok/step x * none's step time / the variant's)
    # rounds: the median of the per-round ratios and their range (a round in which none
    # stalled lifts the geometric mean, not the median)
    print(f"{'variant':11} {'B':>3} {'ctx':>6} {'tok/s':>9} {'x none':>7} "
          f"{'rounds med [min-max]':>21} {'tok/step x':>10} "
          f"{'AL':>5} {'drafted':>8} {'skipped':>24} {'greedy':>7} {'gc ms/step':>10}")
    ok = True
    for r in rows:
        b = base[r["batch"]]
        r["greedy_equal"] = r["tokens"] == b["tokens"] and r["all_runs_tokens_equal"]
        # First differing output position per request (None: identical), to tell a late bf16
        # near-tie flip from a logic error that diverges at once.
        r["first_divergence"] = [next((j for j, (p, q) in enumerate(zip(x, y)) if p != q),
                                      None if len(x) == len(y) else min(len(x), len(y)))
                                 for x, y in zip(b["tokens"], r["tokens"])]
        ok &= r["greedy_equal"]
        policy = r["policy"] or {}
        al = r["mean_acceptance_length"]
        r["x_none_per_step"] = r["tokens_per_step"] / b["tokens_per_step"]
        med, lo, hi = round_spread(r["x_none_rounds"])
        r["x_none_median_round"] = med
        print(f"{r['variant']:11} {r['batch']:>3} {r['context']:>6} {r['tok_s']:9.1f} "
              f"{r['x_none']:7.3f} {f'{med:.3f} [{lo:.3f}-{hi:.3f}]':>21} "
              f"{r['x_none_per_step']:10.3f} "
              f"{'-' if al is None else f'{al:.2f}':>5} "
              f"{policy.get('num_drafted', '-')!s:>8} "
              f"{json.dumps(policy.get('num_skipped', {})):>24} "
              f"{'ok' if r['greedy_equal'] else 'DIFF':>7} "
              f"{r.get('gc_ms_per_step', float('nan')):10.3f}")
    for r in rows:
        if r["runs_timed_in_tuner_trial"]:
            print(f"note: {r['variant']} B={r['batch']}: {r['runs_timed_in_tuner_trial']} of "
                  f"{len(r['tok_s_runs'])} runs began timing inside the early draft tuner's "
                  "trial (raise --warmup-steps to time the decided path only)")
    never = {r["batch"]: r for r in rows if r["variant"] == "never"}
    for r in rows:
        if r["variant"] == "auto-nopay":
            verdict = "within 5%" if r["x_none"] >= 0.95 else "NOT within 5%"
            # "never" drafts nothing but still carries the drafter (block drafters write their
            # context KV inside every target step) and runs plain decodes of a speculative
            # engine: auto-nopay / never is the policy's own cost, never / none the engine's.
            if r["batch"] in never:
                print(f"B={r['batch']}: auto-nopay / never = "
                      f"{r['x_none'] / never[r['batch']]['x_none']:.3f}, never / none = "
                      f"{never[r['batch']]['x_none']:.3f}")
            rounds = ", ".join(f"{x:.3f}" for x in r["x_none_rounds"])
            print(f"B={r['batch']}: auto-nopay at {r['x_none']:.3f}x of no speculation "
                  f"(rounds: {rounds}) "
                  f"({verdict}); cost model step times: "
                  f"{json.dumps(((r['policy'] or {}).get('cost_model') or {}).get('step_times'))}")
    with open(os.path.join(args.out, "spec_policy.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    if not ok:
        diverged = {f"{r['variant']} B={r['batch']}": r["first_divergence"]
                    for r in rows if not r["greedy_equal"]}
        raise SystemExit(
            f"greedy tokens differ from no speculation (first differing position per request: "
            f"{diverged}). In float32 the outputs must be identical: rerun with --dtype float32 "
            "(CPU: --device cpu --attention-backend TORCH_MLA --enforce-eager); if those match, "
            "the difference is bf16 rounding of the Q=1+k verify shapes against Q=1 at a near-tie")


if __name__ == "__main__":
    main()
