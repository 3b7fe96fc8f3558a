"""In-process A/B of lean Triton launches (vllm/utils/triton_launch.py): the speculation-policy
cases (vllm.benchmarks.spec_policy; default: none and DSpark "always") with lean launches off
and on, in alternating order round by round in one process, since one engine's tok/s moves by
up to 2x between processes on the GPU node. Prints, per batch size and setting, the median
tok/s and the median of the rounds' variant / none ratios, and the launch counts.

Usage (GPU node): python scripts/ab_lean_launch.py --batch-sizes 1 8 --rounds 4
CPU smoke run: ... --device cpu --dtype float32 --attention-backend TORCH_MLA --enforce-eager
(the CPU path launches no Triton kernels: both settings run the same code)
"""
from __future__ import annotations

import argparse
import json

from vllm.benchmarks.rounds import setting_rows, setting_table
from vllm.benchmarks.spec_policy import (
    VARIANTS,
    SpecPolicyCase,
    add_engine_args,
    engine_kwargs,
    run_case,
)
from vllm.benchmarks.host_waits import HostWaits
from vllm.utils.triton_launch import launch_counts, set_lean_launches


def _count_delta(before: dict, after: dict) -> dict[str, tuple[int, int]]:
    """Launches made between two launch_counts() snapshots, per kernel (lean, through Triton)."""
    delta = {}
    for name, (lean, triton) in after.items():
        lean0, triton0 = before.get(name, (0, 0))
        if lean - lean0 or triton - triton0:
            delta[name] = (lean - lean0, triton - triton0)
    return delta


def run(args) -> dict:
    tok_s: dict[tuple, list[float]] = {}
    # per (batch, variant), lean on: launches by kernel, summed over the timed rounds. A kernel
    # going through Triton every step in one case (a specialization that changes step to step)
    # would cost that case the binding the lean path saves, and more (it re-learns each time).
    case_launches: dict[tuple, dict[str, list[int]]] = {}
    # --host-waits: per (lean, batch, variant), where the host blocked on the GPU in the timed
    # steps (event synchronizations by call site, host_waits.py), summed over the rounds
    host_waits: dict[tuple, dict[str, list]] = {}
    host_steps: dict[tuple, int] = {}
    for rnd in range(args.warmup_rounds + args.rounds):
        order = (False, True) if rnd % 2 == 0 else (True, False)
        for lean in order:
            set_lean_launches(lean, args.kernels)
            for batch in args.batch_sizes:
                for variant in args.variants:
                    case = SpecPolicyCase(variant, batch, output_len=args.output_len,
                                          warmup_steps=args.warmup_steps, **engine_kwargs(args))
                    before = launch_counts()
                    waits = HostWaits() if args.host_waits else None
                    done = run_case(case, timed_region=waits)
                    result = done["tok_s"]
                    if rnd >= args.warmup_rounds:
                        tok_s.setdefault((lean, batch, variant), []).append(result)
                        if waits is not None:
                            key = (lean, batch, variant)
                            host_steps[key] = host_steps.get(key, 0) + done["timed_steps"]
                            sums = host_waits.setdefault(key, {})
                            for site, (calls, seconds) in waits.snapshot().items():
                                total = sums.setdefault(site, [0, 0.0])
                                total[0] += calls
                                total[1] += seconds
                        if lean:
                            sums = case_launches.setdefault((batch, variant), {})
                            for name, counts in _count_delta(before, launch_counts()).items():
                                total = sums.setdefault(name, [0, 0])
                                total[0] += counts[0]
                                total[1] += counts[1]
    set_lean_launches(False, args.kernels)
    rows = setting_rows(tok_s, [False, True], args.batch_sizes, args.variants)
    for row in rows:  # the JSON's key for the setting
        row["lean"] = row.pop("setting")
    return {"rows": rows, "tok_s": {f"{k[0]}:{k[1]}:{k[2]}": v for k, v in tok_s.items()},
            "launches": launch_counts(),
            "host_waits": {f"{'on' if k[0] else 'off'}:{k[1]}:{k[2]}": {
                site: (calls / host_steps[k], seconds * 1e3 / host_steps[k])
                for site, (calls, seconds) in sorted(sites.items(), key=lambda x: -x[1][1])}
                for k, sites in host_waits.items()},
            "case_launches": {f"{b}:{v}": {n: tuple(c) for n, c in counts.items()}
                              for (b, v), counts in case_launches.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", default=["none", "always"], choices=VARIANTS,
                        help="the first is the baseline of the ratios")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--kernels", nargs="+", default=None,
                        help="switch only these kernels' launchers (e.g. "
                             "_block_draft_inputs_kernel); the others keep their defaults")
    parser.add_argument("--warmup-rounds", type=int, default=1)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--warmup-steps", type=int, default=32)
    add_engine_args(parser)
    parser.add_argument("--host-waits", action="store_true",
                        help="time the host's CUDA event waits by call site in the timed steps "
                        "(vllm/benchmarks/host_waits.py)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if len(args.variants) < 2:
        parser.error("--variants needs a baseline and at least one more variant")
    result = run(args)
    print(setting_table([dict(r, setting=r["lean"]) for r in result["rows"]], "lean",
                        args.variants, label=lambda lean: "on" if lean else "off"))
    print("launches (lean, through Triton):", result["launches"])
    for case, counts in result["case_launches"].items():
        print(f"lean on, B:variant {case}: (lean, through Triton) per kernel {counts}")
    for case, sites in result["host_waits"].items():
        total = sum(ms for _, ms in sites.values())
        print(f"host waits, lean:B:variant {case}: {total:.3f} ms per timed step; top sites "
              "(waits per step, ms per step): "
              + "; ".join(f"{site} {calls:.2f} {ms:.3f}" for site, (calls, ms)
                          in list(sites.items())[:4]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
