"""`vllm bench throughput` (see offline_bench.py)."""
from vllm.benchmarks.offline_bench import add_throughput_args as add_cli_args
from vllm.benchmarks.offline_bench import run_throughput as main
__all__ = ["add_cli_args", "main"]
