"""`vllm generate`: offline completions, and with no model the project's main job: the built-in
tiny model with DSpark speculative decoding, printing its acceptance statistics."""
from __future__ import annotations

import argparse
import os
import time

from vllm.entrypoints.cli.engine_setup import add_model_and_engine_args, create_vllm_config
from vllm.entrypoints.cli.errors import CLIError

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Speculative decoding works by",
    "Once upon a time, in a small village,",
    "The quick brown fox",
    "In 1969, astronauts",
    "A haiku about GPUs:",
    "Decode context parallelism shards the KV cache",
)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate completions offline (default: tiny model + DSpark)",
        description="Generate completions for prompts. With no MODEL_DIR, runs the built-in tiny "
                    "DeepSeek-style model with DSpark speculative decoding and prints acceptance "
                    "statistics.")
    add_model_and_engine_args(parser, "local model directory (default: the built-in tiny model "
                                      "with its DSpark drafter)")
    group = parser.add_argument_group("generation")
    group.add_argument("--prompt", action="append", default=None, metavar="P",
                       help="a prompt (repeatable)")
    group.add_argument("--prompts-file", default=None, metavar="F",
                       help="text file with one prompt per line (blank lines skipped)")
    group.add_argument("--max-tokens", type=int, default=24, help="tokens per completion")
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    group.add_argument("--top-p", type=float, default=None)
    group.add_argument("--top-k", type=int, default=None)
    group.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(dispatch=run)


def load_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        if not os.path.isfile(args.prompts_file):
            raise CLIError(f"--prompts-file {args.prompts_file!r} does not exist")
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
        if not prompts:
            raise CLIError(f"--prompts-file {args.prompts_file!r} holds no prompts")
    return prompts or list(DEFAULT_PROMPTS)


def make_sampling_params(args: argparse.Namespace):
    from vllm.sampling_params import SamplingParams

    kwargs = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.top_p is not None:
        kwargs["top_p"] = args.top_p
    if args.top_k is not None:
        kwargs["top_k"] = args.top_k
    return SamplingParams(**kwargs)


def run(args: argparse.Namespace) -> int:
    from vllm.benchmarks.offline import format_spec_stats, run_requests, spec_decode_delta
    from vllm.v1.engine.llm_engine import LLMEngine

    prompts = load_prompts(args)
    params = make_sampling_params(args)  # validate before the (slower) engine start
    start = time.perf_counter()
    config, display = create_vllm_config(args)
    engine = LLMEngine.from_vllm_config(config)
    load_s = time.perf_counter() - start
    before = (engine.get_metrics() or {}).get("spec_decode")
    gen_start = time.perf_counter()
    results = run_requests(engine, prompts, params, progress=not args.no_progress)
    gen_s = time.perf_counter() - gen_start
    spec = spec_decode_delta(before, (engine.get_metrics() or {}).get("spec_decode"))

    for index, result in enumerate(results):
        print(f"--- [{index}] prompt: {result.prompt!r}")
        print(f"    completion ({len(result.token_ids)} tokens, {result.finish_reason}): "
              f"{result.text!r}")
    num_tokens = sum(len(r.token_ids) for r in results)
    method = config.speculative_config.method if config.speculative_config else "none"
    print(f"=== model {display}, speculative method {method}: {len(results)} prompts, "
          f"{num_tokens} tokens in {gen_s:.2f} s ({num_tokens / max(gen_s, 1e-9):.1f} tok/s; "
          f"engine start {load_s:.2f} s)")
    for line in format_spec_stats(spec):
        print(line)
    return 0
