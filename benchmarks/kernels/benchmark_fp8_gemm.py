"""W8A8 block-FP8 GEMM (Triton, layers/quantization/fp8_kernels.py) vs the bf16 GEMM (cuBLAS via
F.linear) at DeepSeek-V3 per-TP8-rank projection shapes.

Each row: median of CUDA-event-timed repeats for fp8 (activation quantisation + GEMM, what a layer
runs) and bf16, the speed-up, and the weight bytes of both (fp8 = 1 byte/elem + float32 block scales).

Usage (GPU node):  python benchmarks/kernels/benchmark_fp8_gemm.py [--m 1,32,128] [--repeats 100]
                   [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json

import torch

from vllm.benchmarks.timing import time_cuda
import torch.nn.functional as F

SHAPES = {"q_a_proj": (1536, 7168), "q_b_proj": (3072, 1536), "kv_a_proj": (576, 7168),
          "o_proj": (7168, 2048), "gate_up_proj": (4608, 7168), "down_proj": (7168, 2304)}
BLOCK = (128, 128)


def main() -> None:
    from vllm.model_executor.layers.quantization.fp8_kernels import apply_w8a8_block_fp8_linear
    from vllm.model_executor.layers.quantization.fp8_utils import block_quantize

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", default="1,32,128", help="token counts (comma-separated)")
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--json", default=None, help="write the rows to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_fp8_gemm needs a CUDA GPU")
    rows = []
    print(f"{'layer':>13} {'M':>4} {'N':>5} {'K':>5} {'bf16 us':>9} {'fp8 us':>9} {'speedup':>8} "
          f"{'bf16 MB':>8} {'fp8 MB':>7}")
    for m in (int(v) for v in args.m.split(",")):
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, device="cuda") / k ** 0.5
            w_bf16 = w.to(torch.bfloat16)
            qw, sw = block_quantize(w, BLOCK)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            bf16 = time_cuda(lambda: F.linear(x, w_bf16), args.repeats, warmup=10) * 1e3
            fp8 = time_cuda(lambda: apply_w8a8_block_fp8_linear(x, qw, sw, BLOCK), args.repeats,
                            warmup=10) * 1e3
            row = dict(layer=name, m=m, n=n, k=k, bf16_us=bf16, fp8_us=fp8, speedup=bf16 / fp8,
                       bf16_weight_bytes=w_bf16.numel() * 2,
                       fp8_weight_bytes=qw.numel() + sw.numel() * sw.element_size())
            rows.append(row)
            print(f"{name:>13} {m:>4} {n:>5} {k:>5} {bf16:>9.1f} {fp8:>9.1f} {row['speedup']:>7.2f}x "
                  f"{row['bf16_weight_bytes'] / 1e6:>8.2f} {row['fp8_weight_bytes'] / 1e6:>7.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
