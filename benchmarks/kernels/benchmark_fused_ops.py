"""Fused decode-path ops vs the unfused torch sequences they replace (CUDA only).

Rows (DeepSeek-V3 per-TP8-rank dims: hidden 7168, 16 heads, q_lora 1536, kv_lora 512, rope 64,
256 experts top-8 with moe_intermediate 2048 / 8 = 256), each at T tokens:
  add+rmsnorm   RMSNorm(x, residual) (one Triton kernel) vs `h = x + r; rmsnorm(h)` in torch
  rmsnorm-1536  q_a_layernorm (no residual) vs torch
  rope          Triton RoPE of q_pe [T,16,64] + k_pe vs the float32 torch rotation
  rope+kv-write rope_concat_and_cache_mla (one launch) vs torch rope + torch cache write
  moe           Triton grouped GEMM (sync-free) vs the per-expert loop it replaced
                (argsort + bincount().tolist() + a loop over the chosen experts)
Times are medians over many repeats: ops that can be captured run N calls inside one CUDA graph
(replayed and CUDA-event timed, per-call time = replay / N), marked "graph"; the old sequences
that sync with the host (boolean-mask cache write, `.tolist()`) cannot be captured and are
CUDA-event timed call by call, marked "events" (their time includes the launch overhead a graph
would hide, which is part of what the fused ops remove). GB/s = the minimum bytes the op must move / time, next to the device-to-device copy
bandwidth measured in the same run.

Usage (GPU node): python benchmarks/kernels/benchmark_fused_ops.py [--tokens 1,8,64] [--repeats 200]
"""
from __future__ import annotations

import argparse

import torch

from vllm.benchmarks.timing import time_cuda
import torch.nn.functional as F


def time_events(fn, repeats: int, warmup: int = 10) -> float:
    """Median milliseconds of one fn() call, CUDA-event timed call by call."""
    return time_cuda(fn, repeats, warmup)


def time_graph(fn, repeats: int, calls_per_graph: int = 20) -> tuple[float, str]:
    """Median milliseconds per call with `calls_per_graph` calls captured in one CUDA graph."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    ms = time_events(graph.replay, max(repeats // 4, 10), warmup=3)
    return ms / calls_per_graph, "graph"


def time_synced(fn, repeats: int) -> tuple[float, str]:
    """For sequences that sync with the host (cannot be captured): event timing per call."""
    return time_events(fn, repeats), "events"


def copy_bandwidth_gbs(repeats: int) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_events(lambda: dst.copy_(src), repeats=max(repeats // 10, 10))
    return 2 * src.numel() / ms / 1e6


def _bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def bench_norms(tokens, repeats, rows):
    from vllm.model_executor.layers.layernorm import rms_norm_torch, rms_norm_triton
    dt = torch.bfloat16
    x, r = (torch.randn(tokens, 7168, device="cuda", dtype=dt) for _ in range(2))
    w = torch.rand(7168, device="cuda", dtype=dt) + 0.5
    moved = _bytes(x, r, w) + 2 * _bytes(x)  # read x, r, w; write out and the new residual
    fused = time_graph(lambda: rms_norm_triton(x, w, 1e-6, r), repeats)
    unfused = time_graph(lambda: rms_norm_torch(x, w, 1e-6, r), repeats)
    rows.append(("add+rmsnorm 7168", tokens, fused, unfused, moved))
    q = torch.randn(tokens, 1536, device="cuda", dtype=dt)
    wq = torch.rand(1536, device="cuda", dtype=dt)
    rows.append(("rmsnorm 1536", tokens, time_graph(lambda: rms_norm_triton(q, wq, 1e-6), repeats),
                 time_graph(lambda: rms_norm_torch(q, wq, 1e-6), repeats), 2 * _bytes(q) + _bytes(wq)))


def bench_rope_and_cache(tokens, repeats, rows):
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding, rope_torch, rope_triton
    from vllm.v1.attention.ops.mla_kv_cache import _concat_and_cache_torch, rope_concat_and_cache_mla
    dt = torch.bfloat16
    rope = RotaryEmbedding(head_size=64, max_position=163840, base=10000.0, interleaved=True).cuda()
    cos, sin = rope.cos_cache, rope.sin_cache
    positions = torch.randint(0, 163840, (tokens,), device="cuda")
    q_full = torch.randn(tokens, 16, 192, device="cuda", dtype=dt)
    q_pe = q_full[..., 128:]
    latent = torch.randn(tokens, 576, device="cuda", dtype=dt)
    kv_c, k_pe = latent[:, :512], latent[:, 512:]
    cache = torch.zeros(4096, 64, 576, device="cuda", dtype=dt)
    slots = torch.randperm(4096 * 64, device="cuda")[:tokens]

    def torch_rope():
        c, s = cos[positions], sin[positions]
        return rope_torch(q_pe, c[:, None], s[:, None], True), rope_torch(k_pe, c, s, True)

    table = 2 * tokens * 32 * 4  # the cos and sin rows read
    moved_rope = 2 * (_bytes(q_pe) + _bytes(k_pe)) + table
    rows.append(("rope q16+k", tokens, time_graph(lambda: rope_triton(positions, q_pe, k_pe, cos, sin, True), repeats),
                 time_graph(torch_rope, repeats), moved_rope))
    k_out = torch.empty(tokens, 64, device="cuda", dtype=dt)

    def fused():
        rope_concat_and_cache_mla(positions, q_pe, k_pe, kv_c, cos, sin, True, cache, slots, k_pe_out=k_out)

    def unfused():
        q_rot, k_rot = torch_rope()
        _concat_and_cache_torch(kv_c, k_rot, cache, slots)  # boolean-mask PAD skip: syncs

    moved = 2 * _bytes(q_pe) + 2 * _bytes(k_pe) + 2 * _bytes(kv_c) + _bytes(k_pe) + _bytes(slots) + table
    rows.append(("rope+kv-write", tokens, time_graph(fused, repeats), time_synced(unfused, repeats), moved))


def bench_moe(tokens, repeats, rows):
    from vllm.model_executor.layers.moe_kernels import fused_experts_triton
    dt, num_experts, top_k, hidden, inter = torch.bfloat16, 256, 8, 7168, 256
    w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda", dtype=dt) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, device="cuda", dtype=dt) * inter ** -0.5
    x = torch.randn(tokens, hidden, device="cuda", dtype=dt)
    ids = torch.stack([torch.randperm(num_experts, device="cuda")[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, device="cuda")

    def per_expert_loop():  # the replaced path: one sort, one host sync, a loop over experts
        out = torch.zeros_like(x)
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        token_of = order // top_k
        weight_of = weights.flatten()[order].to(dt)
        start = 0
        for e, count in enumerate(torch.bincount(flat, minlength=num_experts).tolist()):
            if count == 0:
                continue
            idx = token_of[start:start + count]
            gate, up = F.linear(x[idx], w13[e]).chunk(2, dim=-1)
            out.index_add_(0, idx, F.linear(F.silu(gate) * up, w2[e]) * weight_of[start:start + count, None])
            start += count
        return out

    used = int(torch.unique(ids).numel())
    moved = used * (_bytes(w13[0]) + _bytes(w2[0])) + 2 * _bytes(x)
    rows.append(("moe 256e top8", tokens, time_graph(lambda: fused_experts_triton(x, w13, w2, weights, ids), repeats),
                 time_synced(per_expert_loop, repeats), moved))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,64", help="comma-separated token counts")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_fused_ops.py needs a CUDA GPU")
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs(args.repeats)
    rows = []
    with torch.no_grad():
        for tokens in (int(t) for t in args.tokens.split(",")):
            bench_norms(tokens, args.repeats, rows)
            bench_rope_and_cache(tokens, args.repeats, rows)
            bench_moe(tokens, args.repeats, rows)
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy_gbs:.0f} GB/s")
    header = f"{'op':<18}{'T':>5}{'fused us':>11}{'':>8}{'unfused us':>12}{'':>8}{'speedup':>9}{'fused GB/s':>12}{'% copy':>8}"
    print(header)
    print("-" * len(header))
    for name, tokens, (fused_ms, fused_how), (unfused_ms, unfused_how), moved in rows:
        gbs = moved / fused_ms / 1e6
        print(f"{name:<18}{tokens:>5}{fused_ms * 1e3:>11.2f}{fused_how:>8}{unfused_ms * 1e3:>12.2f}{unfused_how:>8}"
              f"{unfused_ms / fused_ms:>8.2f}x{gbs:>12.0f}{100 * gbs / copy_gbs:>7.0f}%")


if __name__ == "__main__":
    main()
