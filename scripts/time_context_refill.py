"""Time a block drafter's context refill (VLLM_DRAFT_CONTEXT_REFILL=1, context_refill.py) against
what it saves: a DSpark engine under "auto", told that drafting cannot pay (the cost model's
acceptance forced to 1.0, no re-probes), decodes a batch of requests synchronously; then

* its plain steps are timed in alternating blocks, context-free (the refill's plain step: the
  target alone) and writing the drafter's context KV (the default engine's plain step); the
  difference is what a plain step saves by refilling instead;
* the last N positions of every request are refilled several times per N, each pass
  synchronised and timed, through both refill paths (GPUModelRunner.refill_through_decode:
  decode rows of any length, or prefill rows with context).

A refill of N positions per request follows N plain steps that skipped the write (the policy's
probe spacing); it pays when it costs less than those N steps saved, i.e. when the table's last
column, refill ms / (N x saved ms per plain step), is below 1. The
first pass of a size that is slower than the next ones points at a one-time cost (kernel
compilation, lazy module loading), not at the refill's own work.

Usage (GPU node): python scripts/time_context_refill.py --batch 1 8 --tokens 8 64 512
CPU smoke run: ... --device cpu --dtype float32 --attention-backend TORCH_MLA
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import time

import torch


def triton_cache_entries() -> int:
    """Kernels in Triton's on-disk cache (one directory per compiled specialisation): a pass that
    adds entries compiled kernels."""
    root = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton",
                                                               "cache")
    return len(os.listdir(root)) if os.path.isdir(root) else 0


def aten_ops(runner, pieces) -> int:
    """ATen operator calls of one refill (nested calls included): the host work a refill
    costs beside its kernels' own time."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.inference_mode():
        runner._refill_pieces(pieces)
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def synchronize(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def no_probe_cost_model(engine) -> None:
    """Drafting cannot pay (the cost model's acceptance forced to 1.0) and is never re-probed:
    after its first look the policy keeps every step plain, so no refill runs by itself."""
    from vllm.v1.spec_decode.cost_model import CostModelConfig, SpeculationCostModel
    policy = engine.scheduler.spec_policy
    never = 10**6
    policy.cost_model = SpeculationCostModel(policy.num_spec_tokens, dataclasses.replace(
        CostModelConfig(), probe_interval=never, max_probe_interval=never))
    policy.cost_model.acceptance_override = 1.0


def time_plain_steps(engine, blocks: int, block_steps: int, device: str,
                     batch: int) -> tuple[float, float]:
    """Median plain-step ms (context-free, writing), from `blocks` alternating blocks of each.
    Only steps the policy made plain count (StepKinds); the write blocks replace the runner's
    choice for the time of the block (an instance attribute over the method, removed after).
    Every timed step must run all `batch` requests (a preempted or finished one would make
    it a smaller step than its label)."""
    from vllm.benchmarks.spec_step_kinds import StepKinds
    runner = engine.executor.worker.model_runner
    times: dict[str, list[float]] = {"free": [], "write": []}
    kinds = StepKinds(engine)
    try:
        for _, mode in itertools.product(range(blocks), ("free", "write")):
            if mode == "write":
                runner._skips_context = lambda batch, scheduler_output: False
            try:
                for _ in range(block_steps):
                    kinds.before()
                    synchronize(device)
                    start = time.perf_counter()
                    engine.step()
                    synchronize(device)
                    ms = (time.perf_counter() - start) * 1e3
                    kinds.after(ms, {})
                    rows = len(kinds.last.num_scheduled_tokens) if kinds.last else 0
                    if rows != batch:
                        raise RuntimeError(f"a timed step ran {rows} requests, not {batch}: "
                                           "give the engine more KV cache or fewer tokens")
                    if kinds.last_kind == "plain":
                        times[mode].append(ms)
            finally:
                runner.__dict__.pop("_skips_context", None)
    finally:
        kinds.restore()
    if not times["free"] or not times["write"]:
        raise RuntimeError(f"no plain steps were timed ({ {k: len(v) for k, v in times.items()} }"
                           "): the policy drafted; lengthen the warm-up")
    return statistics.median(times["free"]), statistics.median(times["write"])


def time_batch(args, batch: int) -> list[str]:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.worker.gpu.spec_decode.context_refill import ENV_FLAG, RefillPiece

    os.environ[ENV_FLAG] = "1"
    extra = {} if args.device == "cuda" else {"device": args.device}
    longest = max(args.tokens)
    timed = 2 * args.blocks * args.block_steps
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=None, dtype=args.dtype, attention_backend=args.attention_backend,
        max_model_len=64 + longest + timed + 256, max_num_seqs=batch,
        enforce_eager=args.enforce_eager, async_scheduling=False,
        speculative_config={"method": "dspark", "num_speculative_tokens": 4,
                            "disable_by_batch_size": "auto"}, seed=0, **extra))
    rows = []
    try:
        no_probe_cost_model(engine)
        params = SamplingParams(max_tokens=longest + timed + 200, temperature=0.0,
                                ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"r{i}", [(5 + 7 * i + 3 * j) % 250 + 4 for j in range(64)],
                               params)
        for _ in range(longest + 8):  # every request holds > longest computed tokens
            engine.step()
        free_ms, write_ms = time_plain_steps(engine, args.blocks, args.block_steps, args.device,
                                             batch)
        saved = write_ms - free_ms
        rows.append(f"| {batch} | plain step, context-free / writing | - | - | {free_ms:.3f} / "
                    f"{write_ms:.3f} (saves {saved:.3f}) | 1 | - | - | - |")
        runner = engine.executor.worker.model_runner
        states = list(runner.requests.by_id.values())
        if len(states) != batch:
            raise RuntimeError(f"{len(states)} of {batch} requests are resident")
        for tokens, path in itertools.product(args.tokens, args.paths):
            runner.refill_through_decode = path == "decode"
            pieces = [RefillPiece(s, s.num_computed_tokens - tokens, s.num_computed_tokens)
                      for s in states]
            for repeat in range(args.repeats):
                synchronize(args.device)
                compiled = triton_cache_entries()
                start = time.perf_counter()
                with torch.inference_mode():
                    runner._refill_pieces(pieces)
                synchronize(args.device)
                ms = (time.perf_counter() - start) * 1e3
                # the refill against the writes of the plain steps whose positions it refills
                # (one position per request a step): < 1 pays
                pays = (f"{ms / (tokens * saved):.2f}" if saved > 0
                        else "never (nothing saved)")
                rows.append(f"| {batch} | {tokens} x {len(pieces)} rows | {path} | {repeat} | "
                            f"{ms:.3f} | {ms / free_ms:.1f} | "
                            f"{triton_cache_entries() - compiled} | - | {pays} |")
            rows.append(f"| {batch} | {tokens} x {len(pieces)} rows | {path} | profiled | - | - "
                        f"| - | {aten_ops(runner, pieces)} | - |")
    finally:
        engine.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention-backend", default="FLASHINFER_MLA")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 64, 512],
                        help="positions refilled per request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=4,
                        help="alternating blocks of timed plain steps per mode")
    parser.add_argument("--block-steps", type=int, default=16)
    parser.add_argument("--paths", nargs="+", choices=["decode", "prefill"],
                        default=["decode", "prefill"], help="refill paths to time")
    args = parser.parse_args()
    rows = ["| B | refill | path | repeat | ms | context-free plain steps | "
            "Triton kernels compiled | ATen ops | refill / N steps' saving |",
            "|---|---|---|---|---|---|---|---|---|"]
    for batch in args.batch:
        rows += time_batch(args, batch)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
