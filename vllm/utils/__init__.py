"""Process-level helpers (upstream keeps them under vllm/utils too)."""
