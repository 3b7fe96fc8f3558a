"""CUDA timing helpers shared by the benchmark scripts (benchmarks/kernels, benchmarks/engine)."""
from __future__ import annotations

import statistics

import torch


def time_cuda(fn, repeats: int = 50, warmup: int = 5, before=None) -> float:
    """Median milliseconds of one fn() call, CUDA-event timed call by call after `warmup` calls.
    `before` runs untimed ahead of every call (e.g. a barrier lining up the ranks)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        if before is not None:
            before()
            torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def copy_bandwidth(num_bytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s: a copy of num_bytes reads and writes them."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), repeats=repeats, warmup=3)
    return 2 * num_bytes / (ms * 1e-3)
