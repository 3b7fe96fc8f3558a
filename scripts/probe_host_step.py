"""Host cost of a steady decode step, per phase, on any machine (CPU is enough).

The GPU probe (`probe_decode_step.py`) needs a GPU and mixes host time with waits on the GPU.
This one runs the built-in tiny model (or --model) and, by default, STUBS THE MODEL FORWARD: the
runner's `_forward` returns persistent zero hidden states and fixed logits (argmax = one token),
so what is timed is the engine's host work around the model: scheduling, the runner's input
preparation and attention metadata, the (greedy) sampler on those fixed logits, the scheduler
update, the output processor and the request-state bookkeeping. `--real-forward` runs the model.

It wraps chosen functions with clock accumulators (thread CPU time by default, ~1 us each: time
descheduled on a shared machine is not counted) and reports the median per
step (ms) of each phase over --steps steady decode steps, for every --batch size (with
--repeats N: the smallest of N such medians).

Usage: python scripts/probe_host_step.py --batch 1 8 32 64 --steps 200 [--sync]
    [--output-len 2000] [--json out.json]
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import time
from collections import defaultdict

import torch

from vllm.benchmarks.host_stub import stub_forward

_TIMES: dict[str, float] = defaultdict(float)  # label -> seconds in the current step
_ACTIVE = [False]
# CPU time of this thread by default: on a shared machine, time spent descheduled is not the
# engine's host cost (--clock wall for perf_counter).
_CLOCK = [time.thread_time]


def _wrap(owner, name: str, label: str) -> None:
    original = getattr(owner, name, None)
    if original is None:
        return

    @functools.wraps(original)
    def timed(*args, **kwargs):
        if not _ACTIVE[0]:
            return original(*args, **kwargs)
        clock = _CLOCK[0]
        start = clock()
        try:
            return original(*args, **kwargs)
        finally:
            _TIMES[label] += clock() - start

    setattr(owner, name, timed)


def _instrument(per_request: bool) -> None:
    """Wrap once, on the classes: every engine built afterwards is instrumented."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import llm_engine
    from vllm.v1.worker.gpu import input_batch, model_runner
    runner_cls = model_runner.GPUModelRunner
    _wrap(runner_cls, "_update_states", "runner._update_states")
    _wrap(runner_cls, "_prepare_inputs", "runner._prepare_inputs")
    _wrap(input_batch.InputBatchBuilder, "build", "  InputBatchBuilder.build")
    _wrap(model_runner, "build_attn_metadata", "  build_attn_metadata")
    _wrap(runner_cls, "_forward", "runner._forward (stub)")
    _wrap(runner_cls, "_sample", "runner._sample")
    _wrap(runner_cls, "_copy_step_output", "runner._copy_step_output")
    _wrap(runner_cls, "_finish_step", "runner._finish_step")
    _wrap(runner_cls, "_launched", "runner._launched (async)")
    _wrap(runner_cls, "_collect", "runner._collect (async)")
    _wrap(Scheduler, "schedule", "scheduler.schedule")
    _wrap(Scheduler, "update_from_output", "scheduler.update_from_output")
    _wrap(llm_engine.LLMEngine, "_process_step", "engine._process_step (incl. update)")
    if per_request:  # a wrapper costs ~1 us per call: these inflate the step by ~2 us/request
        _wrap(llm_engine.LLMEngine, "_make_output", "  engine._make_output (finished requests)")
        from vllm.v1.engine import detokenizer
        _wrap(detokenizer.IncrementalDetokenizer, "update", "  detokenizer.update (per request)")


def run_one(batch: int, steps: int, args) -> dict:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine
    ctx = args.context
    max_model_len = ctx + args.output_len + steps + 64
    block_size = EngineArgs.block_size or 16
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=args.model, max_model_len=max_model_len,
        max_num_seqs=max(batch, 1), async_scheduling=not args.sync,
        max_num_batched_tokens=max(2048, batch * ctx),
        # Every request at full length at once: no preemption changes the batch while timing.
        num_gpu_blocks_override=batch * (-(-max_model_len // block_size) + 1) + 8))
    runner = engine.executor.worker.model_runner
    if not args.real_forward:
        stub_forward(runner)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len + steps + 40,
                            ignore_eos=True,
                            detokenize=not args.no_detokenize)
    for i in range(batch):
        engine.add_request(f"r{i}", [(7 * i + 3 * j + 1) % 250 for j in range(ctx)], params)
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(args.output_len):  # outputs are this long when the timed steps start
        engine.step()
    if len(engine.scheduler.running) != batch:
        raise RuntimeError(f"only {len(engine.scheduler.running)} of {batch} requests run "
                           "(preempted?): the probe measures a full batch")
    per_step: dict[str, list[float]] = defaultdict(list)
    step_times = []
    gc.collect()
    for _ in range(steps):
        _TIMES.clear()
        _ACTIVE[0] = True
        t0 = _CLOCK[0]()
        engine.step()
        step_times.append(_CLOCK[0]() - t0)
        _ACTIVE[0] = False
        for label, seconds in _TIMES.items():
            per_step[label].append(seconds)
    engine.shutdown()
    result = {"batch": batch, "step_ms": statistics.median(step_times) * 1e3,
              "phases_ms": {k: statistics.median(v) * 1e3 for k, v in per_step.items()}}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the built-in tiny model")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=10,
                        help="decode steps run before the timed ones (each request's output "
                             "is that long when timing starts: output-length dependence)")
    parser.add_argument("--sync", action="store_true",
                        help="async scheduling off (it is on by default, as in the engine)")
    parser.add_argument("--real-forward", action="store_true",
                        help="run the model instead of the fixed-output stub")
    parser.add_argument("--no-detokenize", action="store_true",
                        help="requests with detokenize=False (no output text)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run each batch size this many times and keep, per phase, the "
                             "smallest median (the machine's noise only adds time)")
    parser.add_argument("--clock", choices=("thread", "wall"), default="thread",
                        help="thread: CPU time of the engine thread (default); wall: perf_counter")
    parser.add_argument("--per-request-phases", action="store_true",
                        help="also time the per-request calls (output making, detokenizer); "
                             "their wrappers inflate the step by ~2 us per request")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    _CLOCK[0] = time.thread_time if args.clock == "thread" else time.perf_counter
    torch.set_num_threads(1)
    from vllm.v1.engine.llm_engine import LLMEngine  # noqa: F401 - import before wrapping
    _instrument(args.per_request_phases)
    results = []
    for b in args.batch:
        runs = [run_one(b, args.steps, args) for _ in range(args.repeats)]
        phases = {k: min(r["phases_ms"].get(k, float("inf")) for r in runs)
                  for k in runs[0]["phases_ms"]}
        results.append({"batch": b, "step_ms": min(r["step_ms"] for r in runs),
                        "phases_ms": phases})
    mode = "sync" if args.sync else "async"
    fwd = "real forward" if args.real_forward else "STUBBED forward (fixed logits), real sampler"
    print(f"# host cost per decode step, {mode}, {fwd}, device=cpu, {args.clock} clock, "
          f"median ms per step (min over {args.repeats} runs)")
    labels = []
    for r in results:
        for k in r["phases_ms"]:
            if k not in labels:
                labels.append(k)
    header = "| phase | " + " | ".join(f"B={r['batch']}" for r in results) + " |"
    print(header)
    print("|---" * (len(results) + 1) + "|")
    print("| **engine.step (wall)** | " + " | ".join(f"**{r['step_ms']:.3f}**" for r in results)
          + " |")
    for label in labels:
        print(f"| {label} | " + " | ".join(f"{r['phases_ms'].get(label, 0.0):.3f}"
                                         for r in results) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": mode, "forward": fwd, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
