"""Engine decode benchmark: steady-state decode steps through the real engine (LLMEngine.step).

For each (drafter, batch size, context, graphs|eager) it reports, side by side in one run:
  step_ms      wall time of one engine step in steady decode: median over blocks of steps (no sync
               inside a block, so a step's GPU tail overlaps the next step's host work) of the block mean
  kernel_ms    summed GPU kernel time of one step (torch.profiler, CUDA activity)
  busy         GPU busy = union of kernel intervals / wall time over the profiled steps (the
               profiler slows the host: a host-bound step reads low)
  b_est        kernel_ms / step_ms (unprofiled step time; one stream, kernels never overlap)
  syncs        host-synchronising CUDA runtime calls per step (stream/event/device sync, memcpy)
  launches     kernel + graph launches per step (CUDA runtime calls)
  tok_s        output tokens per second (accepted drafts + bonus tokens)
  spec_factor  tok/s with drafts / tok/s without (same B, context, mode)
  overhead     (draft + verify) step time / plain step time  (DESIGN §8)
  mbu          (weight bytes + KV bytes read) / (copy bandwidth measured here x step time)
  step_med     median interval between two step returns inside the blocks (no sync); robust to
               a few slow steps, which move the block means of step_ms
  early        the early draft tuner's decision for the batch (early / late; "-": no tuner):
               a block drafter warms up until it has decided, so the timed steps are steady

Usage (GPU): python benchmarks/engine/benchmark_decode.py --batch-sizes 1 8 --contexts 1024
  --methods none dspark --out out/decode   (writes decode.json, decode.png, prints the table)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from vllm.benchmarks.timing import copy_bandwidth
from vllm.benchmarks.warmup import settle_early_draft
from vllm.v1.worker.gpu.spec_decode.early_draft import EarlyDraftTuner

BUDGET_HEADROOM_STEPS = 8  # steps of max_tokens beyond the measured ones (see run_case)
# A block drafter's warm-up goes on until its early draft tuner has decided (the timed steps
# then measure the engine's steady state, not its trial; vllm/benchmarks/warmup.py).
SETTLE_STEPS = EarlyDraftTuner().steps_to_decide + 4

def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total / 1e3  # us -> ms


def run_case(args, method: str, batch: int, context: int, eager: bool,
             async_scheduling: bool = False) -> dict:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    spec = None
    if method != "none":
        spec = {"method": method, "num_speculative_tokens": args.num_spec_tokens}
        if args.draft_model:
            spec["model"] = args.draft_model
    # Token budget with headroom: every measured engine.step() must launch real work. Without it
    # the last profiled step of an async engine found its requests at max_tokens, launched
    # nothing, and kernel_ms (kernels / profile_steps) came out halved (seen 2026-12-01).
    steps = args.warmup_steps + args.steps + args.profile_steps + BUDGET_HEADROOM_STEPS
    if method != "none":
        steps += SETTLE_STEPS
    engine_args = EngineArgs(
        model=args.model, dtype="bfloat16", max_model_len=context + steps * (args.num_spec_tokens + 1) + 64,
        attention_backend=args.attention_backend, speculative_config=spec,
        max_num_seqs=max(batch, 1), max_num_batched_tokens=max(4096, batch * (context + 1)),
        enforce_eager=eager, seed=0, async_scheduling=async_scheduling,
        quantization=args.quantization,
        **({"load_format": args.load_format}
                                         if args.load_format != "auto" else {}))
    engine = LLMEngine.from_engine_args(engine_args)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=steps * (args.num_spec_tokens + 1),
                                ignore_eos=True)
        # Natural text (shipped with Python) so that drafting on a trained model is realistic;
        # request i starts at its own offset. Dummy-weight models just see token ids.
        from pydoc_data.topics import topics
        text = "\n".join(topics[k] for k in sorted(topics))
        ids = engine.tokenizer.encode(text)
        for i in range(batch):
            start = (i * 7919) % max(1, len(ids) - context)
            prompt = [int(t) % 250 for t in ids[start:start + context]]
            engine.add_request(f"r{i}", prompt, params)
        # Prefill (and the first decode steps) until every request decodes.
        while engine.scheduler.waiting:
            engine.step()
        for _ in range(args.warmup_steps):
            engine.step()
        settle_steps, early_draft = (settle_early_draft(engine, engine.step, SETTLE_STEPS)
                                     if method != "none" else (0, "-"))
        tokens_before = engine._num_generation_tokens
        # Blocks of steps between synchronisations: a sync after every step would serialise the
        # GPU tail of each step (e.g. a captured draft step) with the next step's host work, which
        # a serving engine overlaps. step_ms = median over blocks of the block's mean step.
        times, total_s, single = [], 0.0, []
        per_block = max(1, min(args.steps_per_block, args.steps))
        for _ in range(max(1, args.steps // per_block)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            last = t0
            for _ in range(per_block):
                engine.step()
                now = time.perf_counter()
                single.append(now - last)  # host interval between step returns (no sync)
                last = now
            torch.cuda.synchronize()
            block_s = time.perf_counter() - t0
            total_s += block_s
            times.append(block_s / per_block)
        tokens = engine._num_generation_tokens - tokens_before
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            torch.cuda.synchronize()
            w0 = time.perf_counter()
            for _ in range(args.profile_steps):
                engine.step()
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - w0) * 1e3
        if engine.get_num_unfinished_requests() != batch:
            raise RuntimeError(
                f"{engine.get_num_unfinished_requests()} of {batch} requests still running after "
                "the profiled steps: a measured step ran short of work (raise BUDGET_HEADROOM_STEPS)")
        events = prof.events()
        kernels = [(e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        kernel_ms = sum((e - s) for s, e in kernels) / 1e3
        busy_ms = _union_ms(kernels)
        names = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU]
        # Host-blocking runtime calls; the two torch.cuda.synchronize() brackets of the window
        # are subtracted. The runner's own event wait (its one transfer) counts as one per step.
        syncs = sum(1 for n in names if "Synchronize" in n or n == "cudaMemcpy") - 2
        launches = sum(1 for n in names if n in ("cudaLaunchKernel", "cudaLaunchKernelExC",
                                                 "cuLaunchKernel", "cuLaunchKernelEx",
                                                 "cudaGraphLaunch"))
        by_kernel: dict[str, float] = {}
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CUDA:
                by_kernel[e.name] = by_kernel.get(e.name, 0.0) + (e.time_range.end - e.time_range.start)
        top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:8]
        spec_stats = engine.scheduler.get_stats().get("spec_decode") or {}
        n = args.profile_steps
        # Memory ideal of one step: every weight read once + the KV cache of every request read
        # once per layer (target; the drafter's share is small), at the copy bandwidth measured.
        runner = engine.executor.worker.model_runner
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        if runner.draft_model is not None:
            weight_bytes += sum(p.numel() * p.element_size()
                                for p in runner.draft_model.parameters())
        num_layers = int(runner.model.config.num_hidden_layers)
        kv_bytes = batch * (context + 8) * 576 * 2 * num_layers
        ideal_ms = (weight_bytes + kv_bytes) / args.bandwidth * 1e3
        return {
            "method": method, "batch": batch, "context": context,
            "mode": ("async-" if async_scheduling else "") + ("eager" if eager else "graphs"),
            "step_ms": statistics.median(times) * 1e3,
            # Median of single steps (the interval between two step returns inside a block, no
            # sync): in a steady pipelined decode it equals the step period, and unlike block
            # means it is not moved by a few slow steps (scripts/probe_decode_step.py reports the
            # same statistic).
            "step_ms_median_single": statistics.median(single) * 1e3,
            # busy: from the profiled steps (the profiler slows the host, so this undercounts
            # a host-bound step); busy_est: kernel time / unprofiled step time (one stream, so
            # kernels never overlap each other).
            "kernel_ms": kernel_ms / n, "busy": busy_ms / wall_ms,
            "busy_est": min(1.0, kernel_ms / n / (statistics.median(times) * 1e3)),
            "syncs_per_step": syncs / n, "launches_per_step": launches / n,
            "tok_s": tokens / total_s,
            "mean_acceptance_length": spec_stats.get("mean_acceptance_length"),
            # the early draft tuner's decision for this batch ("-": no tuner) and the warm-up
            # steps it took beyond --warmup-steps
            "early_draft": early_draft, "settle_steps": settle_steps,
            "weight_GB": weight_bytes / 1e9, "ideal_ms": ideal_ms,
            "mbu": ideal_ms / (statistics.median(times) * 1e3),
            "top_kernels_ms_per_step": [(k[:80], v / 1e3 / n) for k, v in top],
        }
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model dir (default: built-in tiny)")
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--load-format", default="auto", help="auto or dummy (random weights)")
    parser.add_argument("--attention-backend", default="FLASHINFER_MLA")
    parser.add_argument("--quantization", default=None,
                        help="weight quantisation of the target (fp8: block-FP8 weights; with "
                             "--load-format dummy they are random fp8 with unit-range block scales)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--contexts", type=int, nargs="+", default=None,
                        help="prompt tokens per request (default 1024; 64 for the built-in tiny "
                             "model, which was trained on 129-byte windows: longer prompts leave "
                             "its drafters' acceptance unrepresentative)")
    parser.add_argument("--methods", nargs="+", default=["none", "dspark"])
    parser.add_argument("--modes", nargs="+", default=["graphs", "eager"],
                        choices=["graphs", "eager", "async-graphs", "async-eager"],
                        help="async-* = with --async-scheduling (plain decoding only)")
    parser.add_argument("--num-spec-tokens", type=int, default=4)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--steps-per-block", type=int, default=5,
                        help="steps timed between two synchronisations (step_ms is the median "
                             "over blocks of the block mean)")
    parser.add_argument("--out", default="out/decode")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")
    bandwidth = copy_bandwidth()
    args.bandwidth = bandwidth
    rows = []
    if args.contexts is None:
        args.contexts = [64] if args.model is None else [1024]
    for context in args.contexts:
        for batch in args.batch_sizes:
            for method in args.methods:
                for mode in args.modes:
                    if mode.startswith("async") and method != "none":
                        print(f"skip {method} async: async scheduling runs plain decoding only")
                        continue
                    row = run_case(args, method, batch, context, eager=mode.endswith("eager"),
                                   async_scheduling=mode.startswith("async"))
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "top_kernels_ms_per_step"}),
                          flush=True)
    plain = {(r["batch"], r["context"], r["mode"]): r for r in rows if r["method"] == "none"}
    for r in rows:
        base = plain.get((r["batch"], r["context"], r["mode"]))
        if base and r["method"] != "none":
            r["spec_factor"] = r["tok_s"] / base["tok_s"]
            r["overhead"] = r["step_ms"] / base["step_ms"]
    result = {"copy_bandwidth_GBps": bandwidth / 1e9, "rows": rows,
              "device": torch.cuda.get_device_name(device), "args": vars(args)}
    with open(os.path.join(args.out, "decode.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s on {result['device']}")
    print(f"{'method':8} {'B':>3} {'ctx':>6} {'mode':6} {'step_ms':>8} {'step_med':>8} {'kern_ms':>8} {'busy':>5} {'b_est':>5} "
          f"{'sync':>5} {'launch':>6} {'tok/s':>8} {'AL':>5} {'spec_x':>6} {'ovh':>5} "
          f"{'ideal':>6} {'x_ideal':>7} {'early':>5}")
    for r in rows:
        al = r.get("mean_acceptance_length")
        print(f"{r['method']:8} {r['batch']:>3} {r['context']:>6} {r['mode']:6} {r['step_ms']:8.3f} "
              f"{r['step_ms_median_single']:8.3f} "
              f"{r['kernel_ms']:8.3f} {r['busy']:5.2f} {r['busy_est']:5.2f} {r['syncs_per_step']:5.1f} "
              f"{r['launches_per_step']:6.0f} {r['tok_s']:8.0f} {al if al is None else round(al, 2)!s:>5} "
              f"{r.get('spec_factor', float('nan')):6.2f} {r.get('overhead', float('nan')):5.2f} "
              f"{r['ideal_ms']:6.3f} {r['step_ms'] / r['ideal_ms']:7.1f} {r['early_draft']:>5}")
    by_mode = {(r["method"], r["batch"], r["context"], r["mode"]): r for r in rows}
    for r in rows:
        key = (r["method"], r["batch"], r["context"])
        g = by_mode.get(key + ("graphs",))
        if r["mode"] in ("eager", "async-eager"):
            twin = by_mode.get(key + (r["mode"].replace("eager", "graphs"),))
            if twin:
                print(f"graphs vs eager ({'async' if r['mode'] != 'eager' else 'sync'}) "
                      f"{r['method']} B={r['batch']} ctx={r['context']}: "
                      f"{r['step_ms'] / twin['step_ms']:.2f}x faster with graphs")
        if r["mode"] == "async-graphs" and g:
            print(f"async vs graphs {r['method']} B={r['batch']} ctx={r['context']}: step "
                  f"{g['step_ms'] / r['step_ms']:.2f}x faster with async scheduling; busy "
                  f"{g['busy']:.2f} -> {r['busy']:.2f}; step / kernel time "
                  f"{r['step_ms'] / r['kernel_ms']:.2f}")
    for r in rows:
        if r["mode"] in ("graphs", "async-graphs"):
            print(f"top kernels {r['method']} B={r['batch']} {r['mode']}: " +
                  "; ".join(f"{k} {v:.3f}ms" for k, v in r["top_kernels_ms_per_step"][:5]))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        for method in args.methods:
            for mode in args.modes:
                pts = sorted((r["batch"], r["step_ms"]) for r in rows
                             if r["method"] == method and r["mode"] == mode)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{method} {mode}")
        ax.set_xlabel("batch size (requests)")
        ax.set_ylabel("decode step (ms)")
        ax.set_title("engine decode step")
        ax.legend()
        fig.savefig(os.path.join(args.out, "decode.png"), dpi=120, bbox_inches="tight")
    except Exception as e:  # noqa: BLE001 - the plot is optional
        print("plot skipped:", e)


if __name__ == "__main__":
    main()
