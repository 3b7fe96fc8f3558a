"""MLA decode under DCP on FlashInfer (Hopper fa3): bandwidth, fused DSpark blocks, merge, DCP.

Sections (medians of many CUDA-event-timed repeats):
  (a) Q=1 decode KV read bandwidth at B=64, 32k context, 16 heads vs the card's measured
      device-to-device copy bandwidth (target >= 90 %);
  (b) DSpark non-causal blocks Q in {4,7,8,16}: fused (one request per block) vs flattened
      (one request per row) on the same data (target fused >= 3x faster at Q=8);
  (c) the Triton LSE-merge kernel at B=64, 128 heads (target <= 15 us), torch path for scale;
  (d) DCP=N vs DCP=1 at 64k context, 128 gathered heads: attention + merge time per step and
      KV capacity. With >= N GPUs the N ranks run on N GPUs over NCCL; otherwise the ranks are
      simulated one after another on one GPU (reported as "simulated", time = slowest rank +
      merge, no NCCL).

Usage (GPU node):  source .gpu/env.sh && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
    python benchmarks/kernels/benchmark_mla_dcp.py --out /tmp/mla_bench [--dcp-sizes 1,2,4,8]
Prints a table, writes results.json and mla_dcp.png into --out.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from pathlib import Path

import torch

from vllm.benchmarks.timing import copy_bandwidth, time_cuda

KV_WIDTH, V_DIM, PAGE = 576, 512, 64
WORKSPACE_BYTES = 128 * 1024 * 1024


# ----------------------------------------------------------------- timing
def measured_copy_bandwidth(num_bytes: int = 4 * 1024**3) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    return copy_bandwidth(num_bytes, repeats=20)


# ------------------------------------------------------------ FlashInfer
def flashinfer():
    from vllm.v1.attention.backends.mla.flashinfer_mla import _import_flashinfer
    return _import_flashinfer()


def make_wrapper():
    fi = flashinfer()
    ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    return fi.mla.BatchMLAPagedAttentionWrapper(ws, backend="fa3")


def plan_csr(wrapper, qo_lens, kv_lens, pages_of, heads, scale, causal=False):
    """Plan requests (qo_len_i, kv_len_i) whose pages are pages_of(i)."""
    fi = flashinfer()
    qo = torch.zeros(len(qo_lens) + 1, dtype=torch.int32)
    qo[1:] = torch.tensor(qo_lens).cumsum(0)
    pages = [pages_of(i)[: -(-kv // PAGE)] for i, kv in enumerate(kv_lens)]
    kv_indptr = torch.zeros(len(pages) + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.tensor([p.numel() for p in pages]).cumsum(0)
    wrapper.plan(metadata=fi.mla.MLAPlanMetadata.csr(qo, kv_indptr,
                                                     torch.cat(pages).to(torch.int32),
                                                     torch.tensor(kv_lens, dtype=torch.int32)),
                 num_heads=heads, head_dim_ckv=V_DIM, head_dim_kpe=KV_WIDTH - V_DIM,
                 page_size=PAGE, causal=causal, sm_scale=scale, q_data_type=torch.bfloat16,
                 kv_data_type=torch.bfloat16, lse_mode="basee")


def run_wrapper(wrapper, q, cache):
    return wrapper.run(query=q, kv_cache=cache, return_lse=True, return_lse_base_on_e=True)


def random_cache(num_pages: int) -> torch.Tensor:
    return (torch.randn(num_pages, PAGE, KV_WIDTH, device="cuda", dtype=torch.bfloat16) * 0.5)


# ---------------------------------------------------------------- sections
def section_a(batch=64, ctx=32768, heads=16) -> dict:
    pages_per = ctx // PAGE
    cache = random_cache(batch * pages_per)
    table = torch.arange(batch * pages_per, dtype=torch.int32).view(batch, pages_per)
    q = torch.randn(batch, heads, KV_WIDTH, device="cuda", dtype=torch.bfloat16)
    wrapper = make_wrapper()
    plan_csr(wrapper, [1] * batch, [ctx] * batch, lambda i: table[i], heads, 1 / math.sqrt(192))
    single_ms = time_cuda(lambda: run_wrapper(wrapper, q, cache), repeats=50)
    # Steady state: 10 decode calls back to back per timed interval, as consecutive layers run;
    # this drops the per-call launch gap (~1-2 % of a 0.6 ms call) that the single-call time holds.
    chain = 10
    ms = time_cuda(lambda: [run_wrapper(wrapper, q, cache) for _ in range(chain)],
                   repeats=20) / chain
    kv_bytes = batch * ctx * KV_WIDTH * 2
    copy_bw = measured_copy_bandwidth()
    attn_bw = kv_bytes / (ms * 1e-3)
    return dict(batch=batch, ctx=ctx, heads=heads, ms=ms, single_call_ms=single_ms,
                kv_gb=kv_bytes / 1e9, attn_tb_s=attn_bw / 1e12, copy_tb_s=copy_bw / 1e12,
                fraction_of_copy=attn_bw / copy_bw,
                single_call_fraction_of_copy=kv_bytes / (single_ms * 1e-3) / copy_bw, target=0.90)


def section_b(batch=64, ctx=8192, heads=16, block_sizes=(4, 7, 8, 16)) -> list[dict]:
    pages_per = ctx // PAGE
    cache = random_cache(batch * pages_per)
    table = torch.arange(batch * pages_per, dtype=torch.int32).view(batch, pages_per)
    scale = 1 / math.sqrt(192)
    q1 = torch.randn(batch, heads, KV_WIDTH, device="cuda", dtype=torch.bfloat16)
    wrapper = make_wrapper()
    plan_csr(wrapper, [1] * batch, [ctx] * batch, lambda i: table[i], heads, scale)
    q1_ms = time_cuda(lambda: run_wrapper(wrapper, q1, cache))
    rows = []
    for block in block_sizes:
        q = torch.randn(batch * block, heads, KV_WIDTH, device="cuda", dtype=torch.bfloat16)
        fused_w, flat_w = make_wrapper(), make_wrapper()
        plan_csr(fused_w, [block] * batch, [ctx] * batch, lambda i: table[i], heads, scale)
        plan_csr(flat_w, [1] * (batch * block), [ctx] * (batch * block),
                 lambda i: table[i // block], heads, scale)
        fused_out, _ = run_wrapper(fused_w, q, cache)
        flat_out, _ = run_wrapper(flat_w, q, cache)
        max_diff = (fused_out.float() - flat_out.float()).abs().max().item()
        fused_ms = time_cuda(lambda: run_wrapper(fused_w, q, cache))
        flat_ms = time_cuda(lambda: run_wrapper(flat_w, q, cache))
        rows.append(dict(Q=block, batch=batch, ctx=ctx, fused_ms=fused_ms, flattened_ms=flat_ms,
                         speedup=flat_ms / fused_ms, fused_vs_q1=fused_ms / q1_ms,
                         max_abs_diff=max_diff))
    return rows


def _graph_of(fn):
    """Capture fn() in a CUDA graph (after a warm-up on a side stream); return its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def section_c(batch=64, heads=128, world_sizes=(2, 4, 8)) -> list[dict]:
    from vllm.v1.attention.ops.dcp_combine import (correct_attn_out_torch,
                                                   correct_attn_out_triton)
    rows = []
    for n in world_sizes:
        out = torch.randn(batch, heads, V_DIM, device="cuda", dtype=torch.bfloat16)
        lses = torch.randn(n, batch, heads, device="cuda")
        triton_us = 1e3 * time_cuda(lambda: correct_attn_out_triton(out, lses, 0), repeats=200)
        torch_us = 1e3 * time_cuda(lambda: correct_attn_out_torch(out, lses, 0), repeats=100)
        # Decode steps run under CUDA graphs in production, where the ~20-40 us of Python/Triton
        # launch latency that the eager number includes disappears: time a graph replay too.
        merge = lambda: correct_attn_out_triton(out, lses, 0)  # noqa: E731
        graph_us = 1e3 * time_cuda(_graph_of(merge), repeats=200)
        # A decode graph holds one merge per layer among other kernels: 20 merges captured back
        # to back give the per-merge cost without the graph launch and event overhead (~5 us).
        chained_us = 1e3 * time_cuda(_graph_of(lambda: [merge() for _ in range(20)]),
                                     repeats=100) / 20
        rows.append(dict(N=n, batch=batch, heads=heads, triton_us=graph_us,
                         triton_chained_us=chained_us, triton_eager_us=triton_us,
                         torch_us=torch_us, target_us=15.0))
    return rows


def _dcp_inputs(n, rank, batch, ctx, heads, device):
    """Sharded cache + metadata of rank `rank` for B requests of global length ctx (I=1)."""
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.mla.flashinfer_mla import FlashInferMLAMetadataBuilder
    from vllm.v1.kv_cache_interface import MLAAttentionSpec
    local = -(-ctx // n)
    pages_per = -(-local // PAGE)
    cache = (torch.randn(batch * pages_per, PAGE, KV_WIDTH, device=device,
                         dtype=torch.bfloat16) * 0.5)
    table = torch.arange(batch * pages_per, dtype=torch.int32, device=device).view(batch, -1)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    seq = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=batch,
        num_actual_tokens=batch, max_query_len=1, max_seq_len=ctx, block_table_tensor=table,
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=device), causal=True)
    config = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=n,
                                                       decode_context_parallel_size=n))
    builder = FlashInferMLAMetadataBuilder(MLAAttentionSpec(block_size=PAGE), ["bench"], config,
                                           device, dcp_rank=rank, kernel_family="hopper")
    q = torch.randn(batch, heads, KV_WIDTH, device=device, dtype=torch.bfloat16)
    return builder.build(0, cm), cache, q


def section_d_simulated(n, batch, ctx, heads) -> dict:
    from vllm.v1.attention.backends.mla.flashinfer_mla import FlashInferMLAImpl
    from vllm.v1.attention.ops.dcp_combine import correct_attn_out
    impl = FlashInferMLAImpl(num_heads=heads, scale=1 / math.sqrt(192))
    rank_ms, parts = [], []
    for r in range(n):
        md, cache, q = _dcp_inputs(n, r, batch, ctx, heads, "cuda")
        rank_ms.append(time_cuda(lambda: impl.forward_decode(q, cache, md.decode)))
        parts.append(impl.forward_decode(q, cache, md.decode))
    lses = torch.stack([p[1] for p in parts])
    merge_ms = time_cuda(lambda: correct_attn_out(parts[0][0], lses, 0), repeats=100)
    return dict(N=n, mode="simulated on 1 GPU" if n > 1 else "1 GPU", attn_ms=max(rank_ms),
                merge_ms=merge_ms if n > 1 else 0.0,
                step_ms=max(rank_ms) + (merge_ms if n > 1 else 0.0))


def _section_d_worker(rank, n, port, batch, ctx, heads, queue):
    import torch.distributed as dist
    from vllm.distributed import parallel_state as ps
    from vllm.v1.attention.backends.mla.flashinfer_mla import FlashInferMLAImpl
    from vllm.v1.attention.ops.dcp_combine import cp_lse_ag_out_rs
    torch.cuda.set_device(rank)
    ps.init_distributed_environment(n, rank, "nccl", f"tcp://127.0.0.1:{port}")
    ps.initialize_model_parallel(n, n)
    dcp = ps.get_dcp_group()
    impl = FlashInferMLAImpl(num_heads=heads, scale=1 / math.sqrt(192))
    md, cache, q = _dcp_inputs(n, rank, batch, ctx, heads, f"cuda:{rank}")

    def attn():
        return impl.forward_decode(q, cache, md.decode)

    def step():
        out, lse = attn()
        return cp_lse_ag_out_rs(out, lse, dcp)

    attn_ms = time_cuda(attn)
    step_ms = time_cuda(step, repeats=30, before=dist.barrier)
    results = [None] * n
    dist.all_gather_object(results, (attn_ms, step_ms))
    if rank == 0:
        queue.put(dict(N=n, mode=f"{n} GPUs, NCCL", attn_ms=max(r[0] for r in results),
                       step_ms=max(r[1] for r in results),
                       merge_ms=max(r[1] for r in results) - max(r[0] for r in results)))
    ps.destroy_distributed_environment()


def section_d(dcp_sizes, batch=32, ctx=65536, heads=128) -> list[dict]:
    import torch.multiprocessing as mp
    rows = []
    free, _ = torch.cuda.mem_get_info()
    for n in dcp_sizes:
        if n == 1 or torch.cuda.device_count() < n:
            row = section_d_simulated(n, batch, ctx, heads)
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            ctx_mp = mp.get_context("spawn")
            queue = ctx_mp.Queue()
            mp.start_processes(_section_d_worker, args=(n, port, batch, ctx, heads, queue),
                               nprocs=n, join=True, start_method="spawn")
            row = queue.get()
        # KV capacity: every GPU holds 1/N of each sequence's latent cache
        row.update(batch=batch, ctx=ctx, heads=heads,
                   kv_bytes_per_token_per_gpu=KV_WIDTH * 2 / n,
                   kv_capacity_tokens_per_80GiB=int(80 * 1024**3 / (KV_WIDTH * 2 / n)))
        rows.append(row)
    return rows


# ------------------------------------------------------------------ report
def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    a = results["a"]
    axes[0].bar(["attention", "copy"], [a["attn_tb_s"], a["copy_tb_s"]], color=["C0", "C7"])
    axes[0].set_title(f"(a) KV read BW, {a['fraction_of_copy']:.0%} of copy")
    axes[0].set_ylabel("TB/s")
    b = results["b"]
    x = [r["Q"] for r in b]
    axes[1].plot(x, [r["fused_ms"] for r in b], "o-", label="fused")
    axes[1].plot(x, [r["flattened_ms"] for r in b], "s-", label="flattened")
    axes[1].set_title("(b) DSpark block decode")
    axes[1].set_xlabel("Q")
    axes[1].set_ylabel("ms")
    axes[1].legend()
    c = results["c"]
    axes[2].bar([str(r["N"]) for r in c], [r["triton_us"] for r in c])
    axes[2].axhline(15, color="r", ls="--", label="target 15 us")
    axes[2].set_title("(c) LSE merge, B=64, 128 heads (graph replay)")
    axes[2].set_xlabel("DCP N")
    axes[2].set_ylabel("us")
    axes[2].legend()
    d = results["d"]
    axes[3].bar([f"N={r['N']}" for r in d], [r["step_ms"] for r in d])
    axes[3].set_title("(d) attention + merge, 64k ctx")
    axes[3].set_ylabel("ms")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(results: dict) -> None:
    a = results["a"]
    print(f"\n(a) decode B={a['batch']} ctx={a['ctx']} H={a['heads']}: {a['ms']:.3f} ms, "
          f"{a['attn_tb_s']:.2f} TB/s vs copy {a['copy_tb_s']:.2f} TB/s = "
          f"{a['fraction_of_copy']:.1%} (target >= 90%); 10 calls back to back. One call alone: "
          f"{a['single_call_ms']:.3f} ms = {a['single_call_fraction_of_copy']:.1%}")
    print("\n(b)  Q | fused ms | flattened ms | speedup | fused / Q=1 | max|diff|")
    for r in results["b"]:
        print(f"   {r['Q']:3d} | {r['fused_ms']:8.3f} | {r['flattened_ms']:12.3f} | "
              f"{r['speedup']:6.2f}x | {r['fused_vs_q1']:10.2f}x | {r['max_abs_diff']:.1e}")
    print("\n(c)  N | triton us (1 graph replay) | triton us (per merge, 20 in a graph) | "
          "triton us (eager) | torch us (eager)   (target <= 15 us)")
    for r in results["c"]:
        print(f"   {r['N']:3d} | {r['triton_us']:25.2f} | {r['triton_chained_us']:36.2f} | "
              f"{r['triton_eager_us']:17.2f} | {r['torch_us']:8.2f}")
    print("\n(d)  N | mode                 | attn ms | merge ms | step ms | KV tokens / 80 GiB")
    for r in results["d"]:
        print(f"   {r['N']:3d} | {r['mode']:20s} | {r['attn_ms']:7.3f} | {r['merge_ms']:8.3f} | "
              f"{r['step_ms']:7.3f} | {r['kv_capacity_tokens_per_80GiB']:,}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory for JSON + PNG")
    parser.add_argument("--dcp-sizes", default="1,2",
                        help="comma list for section (d); real multi-GPU runs need that many GPUs")
    parser.add_argument("--sections", default="abcd", help="subset of 'abcd' to run")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmark_mla_dcp needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    started = time.time()
    results: dict = {"device": torch.cuda.get_device_name(),
                     "torch": torch.__version__, "flashinfer": flashinfer().__version__}
    if "a" in args.sections:
        results["a"] = section_a()
    if "b" in args.sections:
        results["b"] = section_b()
    if "c" in args.sections:
        results["c"] = section_c()
    if "d" in args.sections:
        results["d"] = section_d([int(x) for x in args.dcp_sizes.split(",")])
    results["wall_s"] = time.time() - started
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    if set("abcd") <= set(args.sections):
        print_table(results)
        plot(results, args.out / "mla_dcp.png")
    else:
        print(json.dumps(results, indent=2))
    print(f"\nwrote {args.out / 'results.json'} in {results['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    raise SystemExit(main())
