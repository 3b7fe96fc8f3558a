"""`vllm` console script: serve | generate | bench {latency,throughput,serve} | tiny-model."""
from __future__ import annotations

import sys

from vllm.entrypoints.cli import bench, generate, serve, tiny_model
from vllm.entrypoints.cli.errors import (RUNTIME_FAILURES, USER_ERRORS, OneLineArgumentParser,
                                         debug_enabled, one_line, report_and_exit)


def build_parser() -> OneLineArgumentParser:
    import vllm

    parser = OneLineArgumentParser(
        prog="vllm", description="vLLM-shaped engine for MLA models with speculative decoding "
                                 "under decode context parallelism.")
    parser.add_argument("-v", "--version", action="version", version=f"vllm {vllm.__version__}")
    subparsers = parser.add_subparsers(dest="subcommand", metavar="COMMAND")
    subparsers.required = True
    for module in (serve, generate, bench, tiny_model):
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> None:
    from vllm.engine.arg_utils import expand_dotted_args

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # --speculative-config.method dspark ... -> one --speculative-config JSON.
        argv = expand_dotted_args(argv)
    except ValueError as error:
        report_and_exit("vllm", error, code=2)
    args = parser.parse_args(argv)
    prog = f"vllm {args.subcommand}"
    if getattr(args, "bench_type", None):
        prog += f" {args.bench_type}"
    try:
        code = args.dispatch(args)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    except USER_ERRORS as error:
        if debug_enabled():
            raise
        report_and_exit(prog, error)
    except RUNTIME_FAILURES as error:
        # A worker that died / raised / hung, or a dead engine: not a bug in the CLI, and the
        # worker's own traceback is already on stderr; say what happened in one line.
        if debug_enabled():
            raise
        summary = error.summary() if hasattr(error, "summary") else one_line(error)
        print(f"{prog}: error: {summary} (set VLLM_DEBUG=1 for the traceback)", file=sys.stderr,
              flush=True)
        sys.exit(1)
    sys.exit(code or 0)


if __name__ == "__main__":
    main()
