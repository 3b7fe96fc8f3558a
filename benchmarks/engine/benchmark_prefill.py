"""Long-context prefill benchmark: one long prompt through the real engine (LLMEngine.step).

Engine mode, for each (context L, step budget = --max-num-batched-tokens):
  ttft_ms        median time to first token of one L-token prompt (chunked prefill, max_tokens=1)
  prefill_tok_s  L / ttft
  attn_tflops    attention FLOPs of the prefill / ttft (a lower bound of the kernels' rate: the
                 whole step time is in the denominator)
  mfu            (matmul + attention FLOPs) / ttft / peak (H200 bf16 dense 989 TFLOP/s unless
                 --peak-tflops says otherwise)
  peak_GB        torch.cuda.max_memory_allocated during the prefill, next to weights + KV cache +
                 the planned prefill workspace (vllm/benchmarks/prefill_flops.py states the terms);
                 static_GB = allocated before the request (weights + KV + runner buffers)
  planned_GB     the engine's own plan (worker.memory_profile, made at start-up): weights + runner
                 buffers + KV + the profiled activation peak of a worst-case step + the graph /
                 buffer memory initialize_kv_cache took; peak_over_engine_plan = peak / planned_GB
                 (the analytic estimate stays beside it: peak_over_planned). The profile reads
                 context in passes of the builders' default chunk; --context-chunk-tokens set
                 after start-up is not in it.
Then, at each context, decode: median step time with and without a DSpark drafter (--decode-methods).

Attention-only mode (--attention-only): the MLA prefill attention of one layer alone, as the engine
runs it for a lone L-token prompt in chunks of the budget (default L = 32k): FlashInfer ragged
prefill for each chunk's new tokens (causal) plus the cached context in passes of
--context-chunk-tokens (gather latents, kv_b_proj -> K, V, non-causal, LSE merge). It reports
TFLOP/s of the whole path and of the attention kernels alone (the ">= 350 TFLOP/s at 32k" check).

FLOPs: attention = layers * heads * 2 * L(L+1)/2 * (d_qk + d_v) with d_qk = 192, d_v = 128
(QK^T and PV over the causal pairs; chunking does not change it); matmul = 2 * L * per-token
linear weights (routed experts at top-k / n_routed) + the LM head once.

Usage (GPU, the lead's run):
  python benchmarks/engine/benchmark_prefill.py --out out/prefill
  python benchmarks/engine/benchmark_prefill.py --attention-only --contexts 32k --out out/prefill_attn
CPU smoke:
  python benchmarks/engine/benchmark_prefill.py --model tiny --contexts 256 --chunk 64 \
      --repeats 1 --decode-steps 2 --out /tmp/prefill
Writes prefill.json (+ prefill.png when matplotlib is present) and prints a table last.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from vllm.benchmarks.prefill_flops import (
    ATTENTION_FLOPS_FORMULA,
    H200_BF16_DENSE_PEAK_TFLOPS,
    MATMUL_FLOPS_FORMULA,
    attention_flops_one_layer,
    chunk_schedule,
    planned_prefill_workspace_bytes,
    prefill_flops,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_MODEL = os.path.join(REPO, "benchmarks", "configs", "deepseek_v3_tp8_rank")
DEFAULT_DRAFT = os.path.join(REPO, "benchmarks", "configs", "deepseek_v3_tp8_rank_dspark")
GB = 1e9


def parse_tokens(text: str) -> int:
    """'32k' -> 32768, '4096' -> 4096."""
    t = text.strip().lower()
    try:
        value = int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"token count {text!r} is not an integer or <n>k "
                                          "(e.g. 32k)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"token count {text!r} must be >= 1")
    return value


class Clock:
    """Wall time that waits for the device on CUDA (the engine step returns before the GPU
    finishes only when nothing reads its results, but the sync makes every sample honest)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def _prompt(n: int, vocab: int, salt: int) -> list[int]:
    # Ids past the special tokens (the tiny vocab keeps 4 specials at the top: stay below them).
    span = max(1, vocab - 16)
    return [(7 * i * i + 3 * i + 101 * salt) % span for i in range(n)]


# ------------------------------------------------------------------------------------ engine
def _engine(args, context: int, budget: int, method: str, decode_tokens: int):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    spec = None
    if method != "none":
        spec = {"method": method, "num_speculative_tokens": args.num_spec_tokens}
        if args.draft_model:
            spec["model"] = args.draft_model
    max_model_len = context + decode_tokens + 2 * (args.num_spec_tokens + 1) + 16
    # The KV cache holds exactly this request (+ slack), not 90% of the GPU, so that peak memory
    # is weights + this context's KV + workspace.
    blocks = math.ceil((max_model_len + 2 * (args.num_spec_tokens + 1)) / args.block_size) + 16
    kwargs = {"model": args.model, "max_model_len": max_model_len, "max_num_seqs": 1,
              "max_num_batched_tokens": budget, "enable_chunked_prefill": True,
              "block_size": args.block_size, "num_gpu_blocks_override": blocks,
              "speculative_config": spec, "enforce_eager": args.enforce_eager, "seed": 0,
              "attention_backend": args.attention_backend, "device": args.device}
    if args.dtype != "auto":
        kwargs["dtype"] = args.dtype
    if args.load_format != "auto":
        kwargs["load_format"] = args.load_format
    engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
    runner = engine.executor.worker.model_runner
    if args.context_chunk_tokens:
        builders = [b for b in runner.attn_metadata_builders
                    if hasattr(b, "prefill_context_chunk_tokens")]
        if not builders:
            engine.shutdown()
            raise ValueError(f"--context-chunk-tokens={args.context_chunk_tokens}: no attention "
                             "metadata builder of this engine takes it; drop the option")
        for builder in builders:
            builder.prefill_context_chunk_tokens = args.context_chunk_tokens
    return engine, runner


def _bytes_of(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _run_to_first_token(engine, rid: str, prompt: list[int], params, clock: Clock) -> float:
    t0 = clock.now()
    engine.add_request(rid, prompt, params)
    while True:
        outs = engine.step()
        if any(o.request_id == rid and len(o.outputs[0].token_ids) > 0 for o in outs):
            break
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"request {rid} finished without a token")
    return clock.now() - t0


def _engine_plan(engine) -> dict:
    """The engine's start-up memory plan (GB), or Nones where it has none (CPU runs)."""
    worker = getattr(engine.executor, "worker", None)
    profile = getattr(worker, "memory_profile", None)
    keys = ("planned_GB", "profiled_activation_GB", "graph_buffer_GB", "runner_buffer_GB",
            "graph_capture_GB", "graph_buffer_estimate_GB")
    if profile is None or profile.planned_bytes is None:
        return {**{k: None for k in keys}, "profile_tokens": None,
                "profile_context_tokens": None, "graph_capture_s": None}

    def gb(x):
        return None if x is None else x / GB
    return {"planned_GB": gb(profile.planned_bytes),
            "profiled_activation_GB": gb(profile.activation_peak_bytes),
            "graph_buffer_GB": gb(profile.graph_buffer_bytes),
            "runner_buffer_GB": gb(profile.runner_buffer_bytes),
            "graph_capture_GB": gb(profile.graph_capture_bytes),
            "graph_buffer_estimate_GB": gb(profile.graph_buffer_estimate_bytes),
            "profile_tokens": profile.profile_tokens,
            "profile_context_tokens": profile.profile_context_tokens,
            "graph_capture_s": profile.graph_capture_seconds}


def _dump_memory_snapshot(args, context: int, budget: int) -> None:
    """The allocation trace up to the end of the first timed prefill, gzip'd pickle (read it with
    pytorch.org/memory_viz or scripts/memory_at_peak.py)."""
    import gzip
    import pickle
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    path = os.path.join(args.memory_snapshot, f"mem_L{context}_b{budget}.pickle.gz")
    os.makedirs(args.memory_snapshot, exist_ok=True)
    with gzip.open(path, "wb") as f:
        pickle.dump(snap, f)
    print(f"memory snapshot: {path}")


def prefill_case(args, context: int, budget: int, device: torch.device) -> dict:
    from vllm.sampling_params import SamplingParams
    clock = Clock(device)
    snapshot = bool(args.memory_snapshot) and device.type == "cuda"
    if snapshot:  # allocation history with Python stacks, from before the engine exists
        torch.cuda.memory._record_memory_history(max_entries=args.memory_snapshot_entries)
    engine, runner = _engine(args, context, budget, "none", decode_tokens=1)
    try:
        config = runner.model.config
        vocab = int(config.vocab_size)
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        cuda = device.type == "cuda"
        # After engine init (weights, KV, runner buffers, CUDA graph pools) and before any request;
        # `static` below is after the warm-up prefills (what they left allocated is the difference).
        init = torch.cuda.memory_allocated(device) if cuda else None
        for w in range(args.warmup):
            _run_to_first_token(engine, f"warm{w}", _prompt(context, vocab, 1000 + w), one, clock)
        static = torch.cuda.memory_allocated(device) if cuda else None
        times, peaks = [], []
        for r in range(args.repeats):
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            times.append(_run_to_first_token(engine, f"p{r}", _prompt(context, vocab, r), one, clock))
            if cuda:
                peaks.append(torch.cuda.max_memory_allocated(device))
            if snapshot and r == 0:
                _dump_memory_snapshot(args, context, budget)
        ttft = statistics.median(times)
        flops = prefill_flops(config, context)
        weights = _bytes_of(runner.model.parameters())
        kv = _bytes_of(runner.kv_caches.values())
        chunk_tokens = int(args.context_chunk_tokens or getattr(
            runner.attn_metadata_builders[0], "prefill_context_chunk_tokens", budget))
        fi_ws = 0
        if getattr(runner.attn_metadata_builders[0], "prefill_backend", "torch") == "flashinfer" \
                and cuda:
            from vllm.v1.attention.backends.mla.prefill import (
                FLASHINFER_PREFILL_WORKSPACE_BYTES,
            )
            fi_ws = FLASHINFER_PREFILL_WORKSPACE_BYTES
        dtype_bytes = next(runner.model.parameters()).element_size()
        planned = planned_prefill_workspace_bytes(config, budget, chunk_tokens, dtype_bytes, fi_ws)
        peak = max(peaks) if peaks else None
        plan = _engine_plan(engine)
        row = {
            "context": context, "budget": budget, "num_steps": len(chunk_schedule(context, budget)),
            "context_chunk_tokens": chunk_tokens,
            "ttft_ms": ttft * 1e3, "ttft_ms_samples": [t * 1e3 for t in times],
            "prefill_tok_s": context / ttft,
            "attention_flops": flops["attention"], "matmul_flops": flops["matmul"],
            "total_flops": flops["total"],
            "attn_tflops": flops["attention"] / ttft / 1e12,
            "engine_tflops": flops["total"] / ttft / 1e12,
            "mfu": flops["total"] / ttft / (args.peak_tflops * 1e12),
            "weights_GB": weights / GB, "kv_cache_GB": kv / GB,
            "planned_workspace_GB": planned / GB,
            # Allocated before the request: weights + KV + the runner's persistent buffers;
            # `other_static_GB` is what is neither weights nor KV.
            "init_GB": None if init is None else init / GB,
            "static_GB": None if static is None else static / GB,
            "other_static_GB": None if static is None else (static - weights - kv) / GB,
            "peak_GB": None if peak is None else peak / GB,
            "transient_GB": None if peak is None else (peak - static) / GB,
            "peak_over_planned": None if peak is None else peak / (weights + kv + planned),
            **plan,
            "peak_over_engine_plan": (None if peak is None or plan["planned_GB"] is None
                                      else peak / (plan["planned_GB"] * GB)),
        }
        return row
    finally:
        engine.shutdown()


def decode_case(args, context: int, budget: int, method: str, device: torch.device) -> dict:
    from vllm.sampling_params import SamplingParams
    clock = Clock(device)
    per_step = args.num_spec_tokens + 1 if method != "none" else 1
    decode_tokens = (args.decode_warmup + args.decode_steps + 2) * per_step
    engine, runner = _engine(args, context, budget, method, decode_tokens)
    try:
        vocab = int(runner.model.config.vocab_size)
        params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
        ttft = _run_to_first_token(engine, "d0", _prompt(context, vocab, 7), params, clock)
        for _ in range(args.decode_warmup):
            engine.step()
        before = engine._num_generation_tokens
        times = []
        for _ in range(args.decode_steps):
            t0 = clock.now()
            engine.step()
            times.append(clock.now() - t0)
        tokens = engine._num_generation_tokens - before
        spec = (engine.scheduler.get_stats().get("spec_decode") or {}) if method != "none" else {}
        return {"context": context, "budget": budget, "method": method,
                "ttft_ms": ttft * 1e3, "step_ms": statistics.median(times) * 1e3,
                "tok_s": tokens / sum(times), "tokens_per_step": tokens / len(times),
                "mean_acceptance_length": spec.get("mean_acceptance_length")}
    finally:
        engine.shutdown()


# ---------------------------------------------------------------------------- attention only
def _median_ms(fn, device: torch.device, repeats: int, warmup: int) -> float:
    if device.type == "cuda":
        from vllm.benchmarks.timing import time_cuda
        return time_cuda(fn, repeats=repeats, warmup=warmup)
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


@dataclass
class _AttentionSetup:
    """What every chunk step of the attention micro-benchmark shares."""
    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    dims: dict
    chunk_tokens: int
    cache: torch.Tensor        # [blocks, block_size, kv_lora_rank + rope] latent cache
    w_kv_b: torch.Tensor       # [heads, nope + v, kv_lora_rank]
    block_table: torch.Tensor  # [1, blocks]
    scale: float
    state: object              # FlashInferPrefillState on CUDA, None for the torch path


def _time_attention_step(setup: _AttentionSetup, ctx: int, q, k, v) -> tuple[float, float]:
    """(path ms, kernels ms) of one chunk step: `q.shape[0]` new tokens after `ctx` cached."""
    from vllm.v1.attention.backends.mla import prefill as P
    from vllm.v1.attention.ops.dcp_combine import merge_attn_states
    device, state, dims = setup.device, setup.state, setup.dims
    nope, rank, v_dim = dims["nope"], dims["kv_lora_rank"], dims["v"]
    heads, d_qk = q.shape[1], q.shape[2]
    m, use_fi, scale = q.shape[0], state is not None, setup.scale
    qsl = torch.tensor([0, m], dtype=torch.int32)
    chunks = []
    if ctx:
        chunks = P._plan_context_chunks(torch.tensor([ctx]), setup.chunk_tokens, setup.block_table,
                                        setup.args.block_size, device, torch.tensor([m]))
    meta = P.MLACommonPrefillMetadata(
        query_start_loc=qsl.to(device), seq_lens=torch.tensor([ctx + m], device=device),
        max_query_len=m, query_start_loc_cpu=qsl, seq_lens_cpu=torch.tensor([ctx + m]),
        context_lens_cpu=torch.tensor([ctx]), local_context_lens_cpu=torch.tensor([ctx]),
        block_table=setup.block_table, context_chunks=chunks,
        context_chunk_tokens=setup.chunk_tokens, has_context=ctx > 0,
        backend="flashinfer" if use_fi else "torch", backend_state=state)
    if use_fi:
        state.begin_step(meta)  # plans are made by the first (warm-up) call, then reused
    self_fn = P.self_attention_flashinfer if use_fi else P.self_attention_torch
    ctx_fn = P.context_attention_flashinfer if use_fi else P.context_attention_torch

    def path():  # what forward_mla_prefill runs for this layer (DCP 1)
        out, lse = self_fn(q, k, v, meta, scale)
        if meta.has_context:
            o_c, l_c = ctx_fn(q, setup.cache, setup.w_kv_b, meta, scale, rank, nope)
            out, lse = merge_attn_states(torch.stack([out, o_c.to(out.dtype)]),
                                         torch.stack([lse.to(l_c.dtype), l_c]))
        return out

    # Kernels alone: the same attention calls on pre-expanded context K / V of every pass.
    flat = setup.cache.reshape(-1, setup.cache.shape[-1])
    passes = [(j, c, *P.expand_latent(flat[c.slots][:, :rank], flat[c.slots][:, rank:],
                                      setup.w_kv_b, nope))
              for j, c in enumerate(chunks) if c.num_tokens]

    def kernels():
        if use_fi:
            wrapper = state.planned("self", 0, qsl, qsl, heads, d_qk, v_dim, True, scale,
                                    setup.dtype)
            P._run_flashinfer(wrapper, q, k, v)
            for j, c, kc, vc in passes:
                wrapper = state.planned("context", j, qsl, c.cu_lens_cpu, heads, d_qk, v_dim,
                                        False, scale, setup.dtype)
                P._run_flashinfer(wrapper, q, kc, vc)
        else:
            P._attend_tiled(q, k, v, scale, True, P.TORCH_TILE_TOKENS)
            for _, _, kc, vc in passes:
                P._attend_tiled(q, kc, vc, scale, False, P.TORCH_TILE_TOKENS)

    repeats = setup.args.attn_repeats
    return (_median_ms(path, device, repeats, 2), _median_ms(kernels, device, repeats, 2))


def attention_case(args, context: int, budget: int, device: torch.device, dims: dict) -> dict:
    """One MLA layer's prefill attention of a lone `context`-token prompt, chunk by chunk."""
    from vllm.v1.attention.backends.mla import prefill as P
    heads, nope, rope, v_dim, rank = (dims["heads"], dims["nope"], dims["rope"], dims["v"],
                                      dims["kv_lora_rank"])
    d_qk = nope + rope
    use_fi = device.type == "cuda"
    dtype = torch.bfloat16 if use_fi else torch.float32
    chunk_tokens = int(args.context_chunk_tokens or P.DEFAULT_CONTEXT_CHUNK_TOKENS)
    block = args.block_size
    num_blocks = math.ceil(context / block) + 1
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * s).to(dtype)

    cache = rand(num_blocks, block, rank + rope, s=0.5)
    w_kv_b = rand(heads, nope + v_dim, rank, s=rank ** -0.5)
    block_table = torch.arange(num_blocks, device=device, dtype=torch.int32)[None]
    scale = d_qk ** -0.5
    setup = _AttentionSetup(args, device, dtype, dims, chunk_tokens, cache, w_kv_b, block_table,
                            scale, P.FlashInferPrefillState(device) if use_fi else None)
    path_ms, kernel_ms = [], []
    for ctx, m in chunk_schedule(context, budget):
        q, k, v = rand(m, heads, d_qk), rand(m, heads, d_qk), rand(m, heads, v_dim)
        step_path, step_kernels = _time_attention_step(setup, ctx, q, k, v)
        path_ms.append(step_path)
        kernel_ms.append(step_kernels)
    flops = attention_flops_one_layer(heads, d_qk, v_dim, context)
    total_path, total_kernels = sum(path_ms), sum(kernel_ms)
    return {"context": context, "budget": budget, "context_chunk_tokens": chunk_tokens,
            "heads": heads, "d_qk": d_qk, "d_v": v_dim, "dtype": str(dtype).replace("torch.", ""),
            "backend": "flashinfer" if use_fi else "torch",
            "num_steps": len(path_ms), "attention_flops": flops,
            "path_ms": total_path, "kernel_ms": total_kernels,
            "path_tflops": flops / (total_path * 1e-3) / 1e12,
            "kernel_tflops": flops / (total_kernels * 1e-3) / 1e12,
            "step_path_ms": path_ms, "step_kernel_ms": kernel_ms}


def _model_dims(args) -> dict:
    from vllm.transformers_utils.config import load_hf_config
    if args.model is None:
        from vllm.model_executor.models.tiny import tiny_target_config
        c = tiny_target_config()
        get = c.__getitem__
    else:
        cfg = load_hf_config(args.model)
        def get(key):
            return getattr(cfg, key)
    return {"heads": int(get("num_attention_heads")), "nope": int(get("qk_nope_head_dim")),
            "rope": int(get("qk_rope_head_dim")), "v": int(get("v_head_dim")),
            "kv_lora_rank": int(get("kv_lora_rank"))}


# ------------------------------------------------------------------------------------ main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Long-context prefill benchmark (engine prefill throughput, attention "
                    "TFLOP/s, MFU, peak memory, decode at that context with/without DSpark).",
        epilog=ATTENTION_FLOPS_FORMULA + ". " + MATMUL_FLOPS_FORMULA + ".",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="model directory (config.json + tokenizer; weights unless --load-format "
                        "dummy), or 'tiny' for the built-in tiny model (CPU smoke runs)")
    p.add_argument("--draft-model", default=None,
                   help="DSpark drafter directory (default: benchmarks/configs/"
                        "deepseek_v3_tp8_rank_dspark for the default model, the built-in tiny "
                        "drafter for --model tiny)")
    p.add_argument("--load-format", default="dummy", choices=["auto", "safetensors", "dummy"],
                   help="dummy = seeded random weights (no checkpoint needed)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--attention-backend", default="auto",
                   help="auto, TORCH_MLA or FLASHINFER_MLA (engine mode)")
    p.add_argument("--contexts", type=parse_tokens, nargs="+", default=[8192, 32768, 131072],
                   help="prompt lengths in tokens (accepts 8k / 32k / 128k)")
    p.add_argument("--max-num-batched-tokens", "--chunk", dest="chunks", type=parse_tokens,
                   nargs="+", default=[2048, 8192],
                   help="per-step token budgets = prefill chunk sizes")
    p.add_argument("--context-chunk-tokens", type=parse_tokens, default=None,
                   help="cached-context tokens per attention pass (default: the backend's, 8192)")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    p.add_argument("--warmup", type=int, default=1, help="untimed prefills before the repeats")
    p.add_argument("--repeats", type=int, default=3, help="timed prefills (median reported)")
    p.add_argument("--decode-methods", nargs="*", default=["none", "dspark"],
                   help="decode rows at each context: none and/or dspark; pass nothing to skip")
    p.add_argument("--num-spec-tokens", type=int, default=4, help="DSpark draft tokens per step")
    p.add_argument("--decode-warmup", type=int, default=3)
    p.add_argument("--decode-steps", type=int, default=20, help="timed decode steps (median)")
    p.add_argument("--attention-only", action="store_true",
                   help="only the prefill-attention micro-benchmark (one layer, no engine)")
    p.add_argument("--attention-contexts", type=parse_tokens, nargs="*", default=None,
                   help="contexts of the attention micro-benchmark in the engine run "
                        "(default: 32k when it is in --contexts; --attention-only uses --contexts)")
    p.add_argument("--attn-repeats", type=int, default=10, help="timed calls per attention step")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_PEAK_TFLOPS,
                   help="MFU denominator (H200 SXM bf16 dense tensor-core peak)")
    p.add_argument("--memory-snapshot", default=None, metavar="DIR",
                   help="CUDA: record the allocation history of each prefill case (engine start "
                        "to the end of its first timed prefill) and dump it into DIR")
    p.add_argument("--memory-snapshot-entries", type=int, default=40000,
                   help="allocation events kept by --memory-snapshot (newest kept)")
    p.add_argument("--out", default="out/prefill", help="output directory")
    return p


def _check_args(args, parser) -> None:
    for name in ("repeats", "decode_steps", "attn_repeats", "num_spec_tokens", "block_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    for name in ("warmup", "decode_warmup"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 0")
    bad = [m for m in args.decode_methods if m not in ("none", "dspark")]
    if bad:
        parser.error(f"--decode-methods {bad} unknown; use none and/or dspark")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is visible; use --device cpu")


def print_table(result: dict) -> None:
    print(ATTENTION_FLOPS_FORMULA)
    print(MATMUL_FLOPS_FORMULA)
    print(f"MFU peak: {result['peak_tflops']:.0f} TFLOP/s ({result['peak_name']}); "
          f"device {result['device']}")
    if result["attention"]:
        print(f"{'attn L':>8} {'chunk':>6} {'ctxpass':>7} {'backend':>10} {'path_ms':>9} "
              f"{'path_TF':>8} {'kern_ms':>9} {'kern_TF':>8}")
        for r in result["attention"]:
            print(f"{r['context']:>8} {r['budget']:>6} {r['context_chunk_tokens']:>7} "
                  f"{r['backend']:>10} {r['path_ms']:9.2f} {r['path_tflops']:8.1f} "
                  f"{r['kernel_ms']:9.2f} {r['kernel_tflops']:8.1f}")
    if result["decode"]:
        print(f"{'decode L':>8} {'method':>7} {'step_ms':>8} {'tok/s':>8} {'tok/step':>8} "
              f"{'AL':>5}")
        for r in result["decode"]:
            al = r["mean_acceptance_length"]
            print(f"{r['context']:>8} {r['method']:>7} {r['step_ms']:8.3f} {r['tok_s']:8.1f} "
                  f"{r['tokens_per_step']:8.2f} {'-' if al is None else f'{al:.2f}':>5}")
    if result["prefill"]:
        def gb(x):
            return "-" if x is None else f"{x:.2f}"
        def ratio(x):
            return "-" if x is None else f"{x:.3f}"
        print(f"{'L':>7} {'chunk':>6} {'ttft_ms':>9} {'tok/s':>9} {'attn_TF':>8} {'MFU':>6} "
              f"{'static':>7} {'peak_GB':>8} {'w+kv+ws':>8} {'ratio':>6} {'plan_GB':>8} "
              f"{'p/plan':>6}")
        for r in result["prefill"]:
            ideal = r["weights_GB"] + r["kv_cache_GB"] + r["planned_workspace_GB"]
            print(f"{r['context']:>7} {r['budget']:>6} {r['ttft_ms']:9.1f} "
                  f"{r['prefill_tok_s']:9.0f} {r['attn_tflops']:8.1f} {r['mfu']:6.1%} "
                  f"{gb(r['static_GB']):>7} {gb(r['peak_GB']):>8} {ideal:8.2f} "
                  f"{ratio(r['peak_over_planned']):>6} {gb(r.get('planned_GB')):>8} "
                  f"{ratio(r.get('peak_over_engine_plan')):>6}")


def _plot(result: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for budget in sorted({r["budget"] for r in result["prefill"]}):
        pts = sorted((r["context"], r["prefill_tok_s"]) for r in result["prefill"]
                     if r["budget"] == budget)
        ax.plot(*zip(*pts), marker="o", label=f"budget {budget}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill tokens / s")
    ax.set_title("engine prefill throughput")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(args, parser)
    if args.model == "tiny":
        args.model = None
    elif args.draft_model is None and os.path.abspath(args.model) == DEFAULT_MODEL:
        args.draft_model = DEFAULT_DRAFT
    if args.model is not None and not os.path.isfile(os.path.join(args.model, "config.json")):
        parser.error(f"--model {args.model}: no config.json there; pass a model directory or tiny")
    device = torch.device(args.device)
    os.makedirs(args.out, exist_ok=True)
    dims = _model_dims(args)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "peak_tflops": args.peak_tflops,
              "peak_name": "H200 bf16 dense" if args.peak_tflops == H200_BF16_DENSE_PEAK_TFLOPS
              else "--peak-tflops",
              "formulas": {"attention": ATTENTION_FLOPS_FORMULA, "matmul": MATMUL_FLOPS_FORMULA,
                           "mfu": "(attention + matmul FLOPs) / ttft / peak"},
              "prefill": [], "decode": [], "attention": []}
    if args.attention_only:
        attn_contexts = args.contexts if args.attention_contexts is None else args.attention_contexts
    elif args.attention_contexts is None:
        attn_contexts = [c for c in args.contexts if c == 32768]
    else:
        attn_contexts = args.attention_contexts
    for context in attn_contexts:
        for budget in args.chunks:
            row = attention_case(args, context, budget, device, dims)
            result["attention"].append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.startswith("step_")}),
                  flush=True)
    if not args.attention_only:
        for context in args.contexts:
            for budget in args.chunks:
                row = prefill_case(args, context, budget, device)
                result["prefill"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "ttft_ms_samples"}),
                      flush=True)
            for method in args.decode_methods:
                row = decode_case(args, context, max(args.chunks), method, device)
                result["decode"].append(row)
                print(json.dumps(row), flush=True)
    result["args"] = vars(args)
    with open(os.path.join(args.out, "prefill.json"), "w") as f:
        json.dump(result, f, indent=1)
    if result["prefill"]:
        _plot(result, os.path.join(args.out, "prefill.png"))
    print_table(result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
