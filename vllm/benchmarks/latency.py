"""`vllm bench latency` (see offline_bench.py)."""
from vllm.benchmarks.offline_bench import add_latency_args as add_cli_args  # noqa: F401
from vllm.benchmarks.offline_bench import run_latency as main  # noqa: F401
