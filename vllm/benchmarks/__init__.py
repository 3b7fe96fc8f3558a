"""`vllm bench latency|throughput|serve`: offline and online benchmarks with TTFT/TPOT/ITL and
speculative-decoding acceptance statistics, printable, savable as JSON and plottable as PNG."""
