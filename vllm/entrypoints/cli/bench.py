"""`vllm bench latency|throughput|serve`."""
from __future__ import annotations

import argparse
import os

from vllm.entrypoints.cli.engine_setup import add_model_and_engine_args
from vllm.entrypoints.cli.errors import CLIError

_MODEL_HELP = "local model directory (default: the built-in tiny model with its DSpark drafter)"


def register(subparsers) -> None:
    from vllm.benchmarks.offline_bench import add_latency_args, add_throughput_args
    from vllm.benchmarks.serve_bench import add_serve_args

    parser = subparsers.add_parser("bench", help="benchmark latency, throughput or a server",
                                   description="Benchmarks printing TTFT/TPOT/ITL, throughput and "
                                               "speculative-decoding acceptance length.")
    kinds = parser.add_subparsers(dest="bench_type", metavar="KIND")
    kinds.required = True
    latency = kinds.add_parser("latency", help="batch latency on an in-process engine")
    add_model_and_engine_args(latency, _MODEL_HELP)
    add_latency_args(latency)
    latency.set_defaults(dispatch=_run_latency)
    throughput = kinds.add_parser("throughput", help="offline throughput on an in-process engine")
    add_model_and_engine_args(throughput, _MODEL_HELP)
    add_throughput_args(throughput)
    throughput.set_defaults(dispatch=_run_throughput)
    serve = kinds.add_parser("serve", help="load a running `vllm serve` over HTTP")
    add_serve_args(serve)
    serve.set_defaults(dispatch=_run_serve)


def check_output_path(path: str | None, flag: str = "--output-json") -> None:
    """Refuse, before the benchmark runs, a result path whose directory does not exist: a typo
    must not silently create directories (nor be found out only after the run)."""
    if not path:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise CLIError(f"{flag} {path!r}: directory {parent!r} does not exist; create it first "
                       "or pick an existing directory")
    if os.path.isdir(path):
        raise CLIError(f"{flag} {path!r} is a directory; give a file path such as "
                       f"{os.path.join(path, 'result.json')!r}")


def _run_latency(args: argparse.Namespace) -> int:
    from vllm.benchmarks.offline_bench import run_latency

    check_output_path(getattr(args, "output_json", None))
    run_latency(args)
    return 0


def _run_throughput(args: argparse.Namespace) -> int:
    from vllm.benchmarks.offline_bench import run_throughput

    check_output_path(getattr(args, "output_json", None))
    run_throughput(args)
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    from vllm.benchmarks.serve_bench import run_serve_bench

    summary = run_serve_bench(args)
    return 1 if summary["num_failed"] else 0
