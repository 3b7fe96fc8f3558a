"""Where the wall time of a steady captured decode step goes, without a profiler's distortion.

cProfile inflates Python-heavy code several-fold, so this wraps a few chosen functions with
perf_counter accumulators (about a microsecond each) and reports, per engine step:
  * wall time of LLMEngine.step and of each wrapped phase (median over the steps, in ms);
  * the host time of one CUDAGraph.replay() call with the GPU idle (sync before) and the GPU time
    of that replay (CUDA events), so a replay that blocks the host is told apart from one that
    waits for earlier work;
  * the kernels one replay launches (torch.profiler), i.e. the graph's size.

Usage (GPU node): python scripts/probe_decode_step.py --model benchmarks/configs/deepseek_v3_tp8_rank \
    --load-format dummy --batch 1 --steps 100 [--speculative-config '{...}'] [--async-scheduling]
    [--cuda-api 20]
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections import defaultdict

import torch

_TIMES: dict[str, list[float]] = defaultdict(list)


def _wrap(owner, name: str, label: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            _TIMES[label].append(time.perf_counter() - start)

    setattr(owner, name, timed)


def _instrument(engine) -> None:
    from vllm.v1.attention.backends.mla import flashinfer_mla
    from vllm.v1.worker.gpu import input_batch, model_runner
    runner = engine.executor.worker.model_runner
    _wrap(model_runner.GPUModelRunner, "execute_model", "runner.execute_model")
    _wrap(model_runner.GPUModelRunner, "_prepare_inputs", "runner._prepare_inputs")
    _wrap(model_runner.GPUModelRunner, "_sample", "runner._sample")
    _wrap(model_runner.GPUModelRunner, "_copy_step_output", "runner._copy_step_output (sync: incl. wait)")
    _wrap(model_runner.GPUModelRunner, "_collect", "runner._collect (async: incl. wait)")
    _wrap(model_runner.GPUModelRunner, "_retire_previous_step", "runner._retire_previous_step (async)")
    _wrap(model_runner.GPUModelRunner, "_propose", "runner._propose")
    _wrap(input_batch.InputBatchBuilder, "build", "InputBatchBuilder.build")
    _wrap(flashinfer_mla, "_plan", "flashinfer plan() (python + C++)")
    _wrap(flashinfer_mla, "plan_hopper_decode", "plan_hopper_decode (CSR on host)")
    _wrap(flashinfer_mla, "_refresh", "flashinfer plan refresh (try, incl. CSR copy)")
    _wrap(flashinfer_mla, "_native_replan", "flashinfer native re-plan")
    _wrap(flashinfer_mla, "_adopt_plan", "flashinfer plan skeleton read-back")
    from vllm.v1.attention.backends.mla import common as mla_common
    from vllm.v1.worker.gpu import block_table
    _wrap(mla_common.MLACommonMetadataBuilder, "_row_seq_lens", "mla._row_seq_lens (device)")
    _wrap(mla_common.MLACommonMetadataBuilder, "_row_seq_lens_host", "mla._row_seq_lens_host")
    _wrap(block_table.BlockTables, "gather_block_tables", "BlockTables.gather_block_tables")
    _wrap(block_table.BlockTables, "compute_slot_mappings", "BlockTables.compute_slot_mappings")
    _wrap(model_runner, "build_attn_metadata", "build_attn_metadata (all groups)")
    _wrap(model_runner.GPUModelRunner, "_sampling_metadata", "runner._sampling_metadata")
    _wrap(type(engine.scheduler), "schedule", "scheduler.schedule")
    _wrap(type(engine.scheduler), "update_from_output", "scheduler.update_from_output")
    _wrap(type(engine), "_process_step", "engine._process_step (incl. update, outputs)")
    if runner.cudagraphs is not None:
        _wrap(type(runner.cudagraphs), "replay", "CudaGraphManager.replay")
    for cls in {type(b) for b in getattr(runner, "attn_metadata_builders", []) or []}:
        _wrap(cls, "build", f"{cls.__name__}.build (all groups)")
    try:
        from flashinfer.mla._batch_mla._backends import _fa_common as fa
        _wrap(fa._BatchMLAGeneratedFaMechanics, "_stage_metadata", "fi._stage_metadata")
        _wrap(fa, "_validate_fa_plan_workload", "fi._validate_fa_plan_workload")
    except Exception as e:  # another FlashInfer layout: the wrapped plan total still shows
        print(f"(FlashInfer internals not wrapped: {e})")


def _replay_probe(runner, repeats: int = 50) -> dict:
    graphs = runner.cudagraphs.graphs
    size = min(graphs)
    graph = graphs[size].graph
    host, gpu = [], []
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeats):
        torch.cuda.synchronize()
        start_ev.record()
        t0 = time.perf_counter()
        graph.replay()
        t1 = time.perf_counter()
        end_ev.record()
        torch.cuda.synchronize()
        host.append((t1 - t0) * 1e3)
        gpu.append(start_ev.elapsed_time(end_ev))
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    launch = [e for e in prof.events() if "GraphLaunch" in e.name]
    return {"graph_size": size, "replay_host_ms": statistics.median(host),
            "replay_gpu_ms": statistics.median(gpu), "kernels_in_graph": len(kernels),
            "cudaGraphLaunch_us": [round(e.cpu_time_total, 1) for e in launch][:3]}


def _cuda_api_probe(engine, steps: int) -> dict:
    """CUDA runtime calls per step, by name, inside `_prepare_inputs` and in the whole step
    (torch.profiler's runtime events). Their host durations say whether a call waits on the
    busy stream (a blocking call lasts as long as the GPU work ahead of it). The profiler adds
    host overhead, so compare sync and async runs of this probe with each other only."""
    from torch.profiler import ProfilerActivity, profile, record_function
    from vllm.v1.worker.gpu import model_runner
    cls = model_runner.GPUModelRunner
    original = cls._prepare_inputs

    def marked(self, *args, **kwargs):
        with record_function("probe::_prepare_inputs"):
            return original(self, *args, **kwargs)

    cls._prepare_inputs = marked
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
    finally:
        cls._prepare_inputs = original
    events = prof.events()
    ranges = sorted((e.time_range.start, e.time_range.end) for e in events
                    if e.name == "probe::_prepare_inputs")

    def inside(t: float) -> bool:
        return any(a <= t <= b for a, b in ranges)

    table: dict[str, dict] = {}
    for e in events:
        name = e.name
        if not (name.startswith("cuda") or name.startswith("cu")) or e.device_type != \
                torch.autograd.DeviceType.CPU:
            continue
        row = table.setdefault(name, {"calls": 0, "us": 0.0, "in_prepare_calls": 0,
                                      "in_prepare_us": 0.0, "max_us": 0.0})
        us = e.time_range.end - e.time_range.start
        row["calls"] += 1
        row["us"] += us
        row["max_us"] = max(row["max_us"], us)
        if inside(e.time_range.start):
            row["in_prepare_calls"] += 1
            row["in_prepare_us"] += us
    for row in table.values():
        for key in ("calls", "us", "in_prepare_calls", "in_prepare_us"):
            row[key] = round(row[key] / steps, 2)
    return dict(sorted(table.items(), key=lambda kv: -kv[1]["us"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--speculative-config", default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="overlap step N+1's host work with step N (plain decoding)")
    parser.add_argument("--cuda-api", type=int, default=0, metavar="STEPS",
                        help="after the timed steps, profile this many more and list the CUDA "
                             "runtime calls per step (inside _prepare_inputs and overall)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine
    kwargs = {} if args.load_format == "auto" else {"load_format": args.load_format}
    spec = json.loads(args.speculative_config) if args.speculative_config else None
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=args.model, dtype="bfloat16", max_model_len=args.context + 8 * args.steps + 64,
        max_num_seqs=max(args.batch, 1), speculative_config=spec,
        attention_backend=args.attention_backend, async_scheduling=args.async_scheduling,
        **kwargs))
    params = SamplingParams(temperature=0.0, max_tokens=6 * args.steps, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [(7 * i + 3 * j + 1) % 250 for j in range(args.context)],
                           params)
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(10):
        engine.step()
    runner = engine.executor.worker.model_runner
    _instrument(engine)
    torch.cuda.synchronize()
    _TIMES.clear()
    step_times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t0)
    result = {"batch": args.batch, "context": args.context,
              "speculative_config": spec, "step_ms": statistics.median(step_times) * 1e3,
              "phases_ms_per_step": {}}
    for label, values in sorted(_TIMES.items(), key=lambda kv: -sum(kv[1])):
        result["phases_ms_per_step"][label] = sum(values) / args.steps * 1e3
    slots = []
    for builder in getattr(runner, "attn_metadata_builders", []) or []:
        slots += (list(getattr(builder, "_slots", {}).values())
                  + list(getattr(builder, "_graph_slots", {}).values()))
    result["flashinfer_plans"] = {"native_replans": sum(s.native_replans for s in slots if s),
                                  "full_plans": sum(s.full_plans for s in slots if s),
                                  "refreshes": sum(s.refreshes for s in slots if s)}
    for s in slots:
        if s is not None and s.refresher is not None:
            result["flashinfer_plans"].setdefault("refresh misses", []).append(
                dict(s.refresher.misses))
    print("  flashinfer plans:", result["flashinfer_plans"])
    if args.cuda_api:
        result["cuda_api_per_step"] = _cuda_api_probe(engine, args.cuda_api)
        print(f"  CUDA runtime calls per step ({args.cuda_api} profiled steps): "
              "calls / us total, of which inside _prepare_inputs, max us of one call")
        for name, row in result["cuda_api_per_step"].items():
            print(f"    {name:32s} {row['calls']:7.1f} / {row['us']:8.1f} us   in prepare "
                  f"{row['in_prepare_calls']:6.1f} / {row['in_prepare_us']:8.1f} us   "
                  f"max {row['max_us']:.1f}")
    if runner.cudagraphs is not None and runner.cudagraphs.graphs:
        result["replay"] = _replay_probe(runner)
    print(f"step {result['step_ms']:.3f} ms (median of {args.steps}), B={args.batch}, "
          f"ctx={args.context}, spec={spec}")
    for label, ms in result["phases_ms_per_step"].items():
        print(f"  {ms:8.3f} ms/step  {label}")
    if "replay" in result:
        print("  replay probe:", result["replay"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    engine.shutdown()


if __name__ == "__main__":
    main()
