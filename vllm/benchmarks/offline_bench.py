"""`vllm bench latency` and `vllm bench throughput` on an in-process LLMEngine.

latency: fixed batches (--batch-size prompts of --input-len tokens, --output-len tokens each) run
--num-iters times after --num-iters-warmup; reports the batch latency distribution plus per-request
TTFT/TPOT/ITL of the measured iterations.
throughput: --num-prompts requests submitted at once; reports request and token throughput.
Both force exactly --output-len tokens per request (ignore_eos) and greedy sampling, and report the
speculative-decoding acceptance of the measured part only (counter deltas).
"""
from __future__ import annotations

import argparse
import time

from vllm.benchmarks.datasets import random_token_prompts
from vllm.benchmarks.offline import run_requests, spec_decode_delta
from vllm.benchmarks.results import describe_ms, format_summary, save_json, save_png, summarize_requests
from vllm.benchmarks.upstream_format import (latency_lines, latency_result, throughput_lines,
                                             throughput_result)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark")
    group.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=32,
                       help="prompt tokens per request")
    group.add_argument("--output-len", "--random-output-len", dest="output_len", type=int,
                       default=32, help="generated tokens per request")
    group.add_argument("--output-json", default=None, metavar="PATH",
                       help="save results as JSON (upstream's keys plus ours)")
    group.add_argument("--output-png", default=None, metavar="PATH", help="save a PNG plot")
    group.add_argument("--no-progress", "--disable-tqdm", dest="no_progress",
                       action="store_true", help="hide progress bars")


def add_offline_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=1, help="samples per prompt (SamplingParams.n)")
    parser.add_argument("--disable-detokenize", action="store_true",
                        help="skip detokenization (time the engine only)")


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    add_offline_args(parser)
    parser.add_argument("--batch-size", type=int, default=4, help="requests per batch")
    parser.add_argument("--num-iters-warmup", type=int, default=1, help="unmeasured iterations")
    parser.add_argument("--num-iters", type=int, default=3, help="measured iterations")


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    add_offline_args(parser)
    parser.add_argument("--num-prompts", type=int, default=32, help="requests in total")
    parser.add_argument("--backend", default="vllm", choices=["vllm"],
                        help="only the in-process engine (upstream's default)")
    parser.add_argument("--dataset-name", default="random", choices=["random"],
                        help="random token prompts of --input-len (no dataset downloads)")


def _check_positive(args, *names) -> None:
    for name in names:
        value = getattr(args, name)
        if value is None or value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def _setup(args):
    from vllm.entrypoints.cli.engine_setup import create_vllm_config
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    config, display = create_vllm_config(args)
    max_len = getattr(config.model_config, "max_model_len", None)
    if max_len is not None and args.input_len + args.output_len > max_len:
        raise ValueError(f"--input-len {args.input_len} + --output-len {args.output_len} exceeds "
                         f"max_model_len {max_len}; shorten them or raise --max-model-len")
    engine = LLMEngine.from_vllm_config(config)
    n = int(getattr(args, "n", 1) or 1)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0 if n == 1 else 1.0,
                            ignore_eos=True, n=n, seed=0 if n > 1 else None,
                            detokenize=not getattr(args, "disable_detokenize", False))
    return config, display, engine, params


def _spec(engine):
    return (engine.get_metrics() or {}).get("spec_decode")


def finish_report(args, title: str, summary: dict, upstream_lines: list[str] = ()) -> dict:
    """Upstream's lines first (scripts grep them), then our summary."""
    for line in upstream_lines:
        print(line)
    print(format_summary(title, summary))
    if args.output_json:
        save_json(args.output_json, summary, vars(args))
        print(f"saved {args.output_json}")
    if args.output_png:
        save_png(args.output_png, title, summary)
        print(f"saved {args.output_png}")
    return summary


def run_latency(args: argparse.Namespace) -> dict:
    _check_positive(args, "input_len", "output_len", "batch_size", "num_iters", "n")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {args.num_iters_warmup}")
    config, display, engine, params = _setup(args)
    prompts = random_token_prompts(engine.tokenizer, args.batch_size, args.input_len,
                                   seed=int(getattr(args, "seed", 0) or 0))
    for it in range(args.num_iters_warmup):
        run_requests(engine, prompts, params, progress=False, id_prefix=f"warmup{it}")
    before = _spec(engine)
    latencies, timers = [], []
    start = time.perf_counter()
    for it in range(args.num_iters):
        t0 = time.perf_counter()
        results = run_requests(engine, prompts, params, progress=not args.no_progress,
                               desc=f"iteration {it + 1}/{args.num_iters}", id_prefix=f"iter{it}")
        latencies.append(time.perf_counter() - t0)
        timers += [r.timer for r in results]
    duration = time.perf_counter() - start
    summary = summarize_requests(timers, duration, args.input_len * len(timers))
    summary["latency"] = describe_ms(latencies)
    summary["_raw"]["latency_s"] = latencies
    summary["spec_decode"] = spec_decode_delta(before, _spec(engine))
    summary["model"] = display
    upstream = latency_result(latencies)
    summary.update(upstream)
    return finish_report(args, f"latency: {display}, batch {args.batch_size}", summary,
                         latency_lines(upstream))


def run_throughput(args: argparse.Namespace) -> dict:
    _check_positive(args, "input_len", "output_len", "num_prompts", "n")
    config, display, engine, params = _setup(args)
    prompts = random_token_prompts(engine.tokenizer, args.num_prompts, args.input_len,
                                   seed=int(getattr(args, "seed", 0) or 0))
    before = _spec(engine)
    start = time.perf_counter()
    results = run_requests(engine, prompts, params, progress=not args.no_progress,
                           desc="throughput", id_prefix="tput")
    duration = time.perf_counter() - start
    summary = summarize_requests([r.timer for r in results], duration,
                                 args.input_len * len(results))
    summary["spec_decode"] = spec_decode_delta(before, _spec(engine))
    summary["model"] = display
    upstream = throughput_result(duration, len(results), summary["total_prompt_tokens"],
                                 summary["total_output_tokens"])
    summary.update(upstream)
    return finish_report(args, f"throughput: {display}, {args.num_prompts} prompts", summary,
                         throughput_lines(upstream))
