"""Decoupled draft parallelism (upstream RFC #53673): the drafter's own DCP size.

`speculative_config.draft_decode_context_parallel_size` is the target's DCP size (the draft KV
is sharded like the target's, partial attention merged across ranks) or 1 under a DCP target:
the draft KV is REPLICATED, every rank stores the full draft context and runs the draft over it
locally, with no cross-rank merge. TP is unchanged (`draft_tensor_parallel_size` = the target's):
each rank computes its own heads either way.
"""
from __future__ import annotations

from typing import Any


def target_dcp_size(vllm_config: Any) -> int:
    parallel = getattr(vllm_config, "parallel_config", None)
    return int(getattr(parallel, "decode_context_parallel_size", 1) or 1)


def draft_dcp_size(vllm_config: Any) -> int:
    """The drafter's DCP size (unset: the target's)."""
    spec = getattr(vllm_config, "speculative_config", None)
    value = getattr(spec, "draft_decode_context_parallel_size", None)
    return target_dcp_size(vllm_config) if value is None else int(value)


def draft_kv_replicated(vllm_config: Any) -> bool:
    """True when the target shards its KV by DCP and the drafter keeps the full context."""
    return (getattr(vllm_config, "speculative_config", None) is not None
            and target_dcp_size(vllm_config) > 1 and draft_dcp_size(vllm_config) == 1)


def mark_dcp_replicated(model: Any) -> int:
    """Mark every attention layer of `model` (the drafter) replicated over the DCP group, before
    its KV cache specs are read and its backend is bound. Returns the number of layers."""
    layers = [m for m in model.modules() if hasattr(m, "dcp_sharded")
              and hasattr(m, "get_kv_cache_spec")]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no attention layer that can keep a "
                         "replicated KV cache; set draft_decode_context_parallel_size to the "
                         "target's decode_context_parallel_size.")
    for layer in layers:
        layer.dcp_sharded = False
    return len(layers)
