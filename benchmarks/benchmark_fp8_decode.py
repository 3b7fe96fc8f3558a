"""Decode step of the DeepSeek-V3 per-TP8-rank benchmark config (benchmarks/configs) with bf16 vs
block-FP8 weights (dummy weights, one GPU), plus the weight bytes of both.

Decode step time = (time to generate N tokens - time to generate 1 token) / (N - 1) for a batch of
B prompts (both timed end to end through vllm.LLM; prefill cancels out), median of repeats.
Decode kernel time = the same difference of the GPU kernel time (torch.profiler, summed over
every kernel) of the two generates: the GPU work per decode step, which host noise does not move
(the wall-clock difference above swung 0.63x-1.08x between two runs on 2026-12-01).

Usage (GPU node):  python benchmarks/benchmark_fp8_decode.py [--model benchmarks/configs/deepseek_v3_tp8_rank]
                   [--batch-sizes 1,16,64] [--output-len 64] [--repeats 5] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

DEFAULT_MODEL = str(Path(__file__).parent / "configs" / "deepseek_v3_tp8_rank")


def weight_bytes(llm) -> int:
    model = llm.llm_engine.executor.worker.model_runner.model
    return sum(p.numel() * p.element_size() for p in model.parameters())


def timed_generate(llm, prompts, max_tokens: int) -> float:
    from vllm import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def kernel_seconds(llm, prompts, max_tokens: int) -> float:
    """Summed GPU kernel time of one generate (torch.profiler CUDA activity)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timed_generate(llm, prompts, max_tokens)
        torch.cuda.synchronize()
    return sum(e.time_range.end - e.time_range.start for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6


def main() -> None:
    import torch

    from vllm import LLM

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_fp8_decode needs a CUDA GPU")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = []
    for quant in (None, "fp8"):
        llm = LLM(model=args.model, load_format="dummy", quantization=quant, dtype="bfloat16",
                  max_model_len=args.input_len + args.output_len + 16, max_num_seqs=max(batch_sizes))
        try:
            nbytes = weight_bytes(llm)
            for b in batch_sizes:
                prompts = [[(7 * i + 13 * j) % 250 + 1 for j in range(args.input_len)] for i in range(b)]
                timed_generate(llm, prompts, args.output_len)  # warm-up (compilation, graphs)
                steps = []
                for _ in range(args.repeats):
                    full = timed_generate(llm, prompts, args.output_len)
                    one = timed_generate(llm, prompts, 1)
                    steps.append((full - one) / (args.output_len - 1))
                kernels = (kernel_seconds(llm, prompts, args.output_len)
                           - kernel_seconds(llm, prompts, 1)) / (args.output_len - 1)
                row = dict(weights=quant or "bf16", batch=b, decode_step_ms=statistics.median(steps) * 1e3,
                           decode_kernel_ms=kernels * 1e3, weight_bytes=nbytes)
                rows.append(row)
                print(f"{row['weights']:>5} B={b:<4} decode step {row['decode_step_ms']:8.3f} ms   "
                      f"kernels {row['decode_kernel_ms']:8.3f} ms   weights {nbytes / 2 ** 30:6.2f} GiB",
                      flush=True)
        finally:
            llm.shutdown()
            del llm
            torch.cuda.empty_cache()
    by = {(r["weights"], r["batch"]): r for r in rows}
    for b in batch_sizes:
        bf, f8 = by[("bf16", b)], by[("fp8", b)]
        print(f"B={b}: fp8/bf16 weight bytes {f8['weight_bytes'] / bf['weight_bytes']:.3f}, "
              f"decode speed-up {bf['decode_step_ms'] / f8['decode_step_ms']:.2f}x (wall), "
              f"{bf['decode_kernel_ms'] / f8['decode_kernel_ms']:.2f}x (GPU kernel time)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
