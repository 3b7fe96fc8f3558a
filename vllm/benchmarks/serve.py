"""`vllm bench serve` (see serve_bench.py)."""
from vllm.benchmarks.serve_bench import add_serve_args as add_cli_args  # noqa: F401
from vllm.benchmarks.serve_bench import run_serve_bench as main  # noqa: F401
