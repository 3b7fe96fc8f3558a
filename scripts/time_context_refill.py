"""Time a block drafter's context refill (VLLM_DRAFT_CONTEXT_REFILL=1, context_refill.py) on its
own: a DSpark engine under "auto" decodes a batch of requests, then refills the last N positions
of every request several times per N, each pass synchronised and timed, beside the median plain
step of the same engine. The first pass of a size that is slower than the next ones points at a
one-time cost (kernel compilation, lazy module loading), not at the refill's own work. Each
size runs through both refill paths (GPUModelRunner.refill_through_decode: decode rows of any
length, or prefill rows with context).

Usage (GPU node): python scripts/time_context_refill.py --batch 1 8 --tokens 8 64 512
CPU smoke run: ... --device cpu --dtype float32 --attention-backend TORCH_MLA
"""
from __future__ import annotations

import argparse
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


def time_batch(args, batch: int) -> list[str]:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.worker.gpu.spec_decode.context_refill import ENV_FLAG, RefillPiece

    os.environ[ENV_FLAG] = "1"
    extra = {} if args.device == "cuda" else {"device": args.device}
    longest = max(args.tokens)
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=None, dtype=args.dtype, attention_backend=args.attention_backend,
        max_model_len=64 + longest + 256, max_num_seqs=batch, enforce_eager=args.enforce_eager,
        speculative_config={"method": "dspark", "num_speculative_tokens": 4,
                            "disable_by_batch_size": "auto"}, seed=0, **extra))
    rows = []
    try:
        params = SamplingParams(max_tokens=longest + 200, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"r{i}", [(5 + 7 * i + 3 * j) % 250 + 4 for j in range(64)],
                               params)
        steps = []
        for _ in range(longest + 8):  # every request holds > longest computed tokens
            synchronize(args.device)
            start = time.perf_counter()
            engine.step()
            synchronize(args.device)
            steps.append(time.perf_counter() - start)
        runner = engine.executor.worker.model_runner
        states = list(runner.requests.by_id.values())
        step_ms = statistics.median(steps[-64:]) * 1e3
        rows.append(f"| {batch} | plain-step median | - | - | {step_ms:.3f} | - | - | - |")
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
                rows.append(f"| {batch} | {tokens} x {len(pieces)} rows | {path} | {repeat} | "
                            f"{ms:.3f} | "
                            f"{ms / step_ms:.1f} | {triton_cache_entries() - compiled} | - |")
            rows.append(f"| {batch} | {tokens} x {len(pieces)} rows | {path} | profiled | - | - "
                        f"| - | {aten_ops(runner, pieces)} |")
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
    parser.add_argument("--paths", nargs="+", choices=["decode", "prefill"],
                        default=["decode", "prefill"], help="refill paths to time")
    args = parser.parse_args()
    rows = ["| B | refill | path | repeat | ms | plain steps | Triton kernels compiled | "
            "ATen ops |", "|---|---|---|---|---|---|---|---|"]
    for batch in args.batch:
        rows += time_batch(args, batch)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
