"""Block-FP8 linear (layers/quantization/fp8_kernels.py: the path `apply_w8a8_block_fp8_linear`
picks, W8A16 weight streaming for decode-sized M, W8A8 above) vs the bf16 GEMM (cuBLAS via
F.linear) at DeepSeek-V3 per-TP8-rank projection shapes.

Each row times both in a CUDA graph (as the decode step runs them) over rotating weight copies
that together exceed twice the L2 cache, so every call streams its weight from HBM as in a model
(a single weight replayed would sit in the 50 MB L2): median over graph replays of the per-call
time. `--eager` adds CUDA-event-timed eager calls (these include the Python launch cost). The
`path` column names the kernel and config the entry point used (tuned table or heuristic), and
fp8 GB/s is the weight bytes streamed per second.

Usage (GPU node):  python benchmarks/kernels/benchmark_fp8_gemm.py [--m 1,32,128] [--repeats 10]
                   [--eager] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

# (N, K) of the dense projections of one DeepSeek-V3 TP8 rank: q_a, q_b (16 heads x 192), kv_a,
# o_proj (16 x 128 in), dense MLP gate_up (2 x 2304) and down
SHAPES = {"q_a_proj": (1536, 7168), "q_b_proj": (3072, 1536), "kv_a_proj": (576, 7168),
          "o_proj": (7168, 2048), "gate_up_proj": (4608, 7168), "down_proj": (7168, 2304)}
BLOCK = (128, 128)


def l2_bytes() -> int:
    return int(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)
               or 64 << 20)


def num_copies(weight_bytes: int, max_copies: int = 64) -> int:
    """Copies of a weight whose total is at least twice the L2 size (each call then misses L2)."""
    return max(1, min(max_copies, -(-2 * l2_bytes() // weight_bytes)))


def time_graph_us(fn, variants: int, calls: int = 32, repeats: int = 10) -> float:
    """Median microseconds per call of fn(i), i cycling over `variants` inputs, with `calls` calls
    captured in one CUDA graph and the graph replayed `repeats` times."""
    calls = max(calls, variants)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles, cuBLAS workspaces) outside the capture
        for i in range(min(variants, 2)):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % variants)
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(samples)


def make_weights(n: int, k: int, seed: int = 0):
    """(fp8 weight copies, their scales, bf16 copies of the dequantised weight): the bf16 GEMM
    multiplies exactly the values the fp8 kernels dequantise."""
    from vllm.model_executor.layers.quantization.fp8_utils import block_dequantize, block_quantize
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qw, sw = block_quantize(torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5, BLOCK)
    w_bf16 = block_dequantize(qw, sw, BLOCK, torch.bfloat16)
    c8 = num_copies(qw.numel() + sw.numel() * 4)
    c16 = num_copies(w_bf16.numel() * 2)
    return ([qw] + [qw.clone() for _ in range(c8 - 1)], [sw] + [sw.clone() for _ in range(c8 - 1)],
            [w_bf16] + [w_bf16.clone() for _ in range(c16 - 1)])


def describe(cfg) -> str:
    s = f"{cfg.kernel} {cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
    return s + (f" split{cfg.split_k}" if cfg.split_k > 1 else "") + (f" g{cfg.group_m}" if cfg.group_m > 1 else "")


def main() -> None:
    from vllm.benchmarks.timing import time_cuda
    from vllm.model_executor.layers.quantization import fp8_kernels as fk

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", default="1,32,128", help="token counts (comma-separated)")
    parser.add_argument("--repeats", type=int, default=10, help="graph replays (eager: calls) per row")
    parser.add_argument("--eager", action="store_true", help="also time eager calls (CUDA events)")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_fp8_gemm needs a CUDA GPU")
    device = torch.device("cuda")
    rows = []
    print(f"{'layer':>13} {'M':>4} {'N':>5} {'K':>5} {'bf16 us':>8} {'fp8 us':>8} {'speedup':>8} "
          f"{'fp8 GB/s':>8} {'bf16 GB/s':>9}" + (f" {'eager bf16':>10} {'eager fp8':>9}" if args.eager else "")
          + "  path")
    for name, (n, k) in SHAPES.items():
        qws, sws, wbf = make_weights(n, k)
        fp8_bytes = qws[0].numel() + sws[0].numel() * 4
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cfg = fk.select_config(m, n, k, BLOCK, fk._device_name(device), torch.bfloat16, fk._num_sms(device))
            bf16 = time_graph_us(lambda i: F.linear(x, wbf[i]), len(wbf), repeats=args.repeats)
            fp8 = time_graph_us(lambda i: fk.apply_w8a8_block_fp8_linear(x, qws[i], sws[i], BLOCK), len(qws),
                                repeats=args.repeats)
            row = dict(layer=name, m=m, n=n, k=k, bf16_us=bf16, fp8_us=fp8, speedup=bf16 / fp8,
                       bf16_weight_bytes=wbf[0].numel() * 2, fp8_weight_bytes=fp8_bytes, path=describe(cfg),
                       fp8_gbps=fp8_bytes / fp8 / 1e3, bf16_gbps=wbf[0].numel() * 2 / bf16 / 1e3)
            line = (f"{name:>13} {m:>4} {n:>5} {k:>5} {bf16:>8.1f} {fp8:>8.1f} {row['speedup']:>7.2f}x "
                    f"{row['fp8_gbps']:>8.0f} {row['bf16_gbps']:>9.0f}")
            if args.eager:
                row["eager_bf16_us"] = time_cuda(lambda: F.linear(x, wbf[0]), args.repeats, warmup=10) * 1e3
                row["eager_fp8_us"] = time_cuda(lambda: fk.apply_w8a8_block_fp8_linear(x, qws[0], sws[0], BLOCK),
                                                args.repeats, warmup=10) * 1e3
                line += f" {row['eager_bf16_us']:>10.1f} {row['eager_fp8_us']:>9.1f}"
            rows.append(row)
            print(line + "  " + row["path"], flush=True)
        qws = sws = wbf = None  # free this shape's weight copies before the next shape
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
