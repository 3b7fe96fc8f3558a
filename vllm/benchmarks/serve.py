"""`vllm bench serve` (see serve_bench.py)."""
from vllm.benchmarks.serve_bench import add_serve_args as add_cli_args
from vllm.benchmarks.serve_bench import run_serve_bench as main
__all__ = ["add_cli_args", "main"]
