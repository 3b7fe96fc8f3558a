"""The `vllm` console script (`vllm.entrypoints.cli.main:main`)."""
