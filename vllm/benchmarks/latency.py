"""`vllm bench latency` (see offline_bench.py)."""
from vllm.benchmarks.offline_bench import add_latency_args as add_cli_args
from vllm.benchmarks.offline_bench import run_latency as main
__all__ = ["add_cli_args", "main"]
