"""Per-step attention metadata, visible to every attention layer during one forward.

`set_forward_context(...)` installs the context immediately and returns a
context manager that restores the previous one on exit, so both
`with set_forward_context(md, cfg): model(...)` and a plain call work.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardContext:
    # layer_name -> MLACommonMetadata (None during profiling / dummy runs)
    attn_metadata: dict[str, Any] | None
    vllm_config: Any = None


_current: ForwardContext | None = None


class _ForwardContextScope:
    def __init__(self, previous: ForwardContext | None):
        self._previous = previous

    def __enter__(self) -> ForwardContext:
        assert _current is not None
        return _current

    def __exit__(self, *exc) -> None:
        global _current
        _current = self._previous


def set_forward_context(attn_metadata: dict[str, Any] | None,
                        vllm_config: Any = None) -> _ForwardContextScope:
    global _current
    previous = _current
    _current = ForwardContext(attn_metadata=attn_metadata, vllm_config=vllm_config)
    return _ForwardContextScope(previous)


class DenseAttention:
    """Marker metadata: attention layers run dense causal attention over the one sequence in
    flight, with no paged KV cache (oracles, training, cache-free references). It must be asked
    for explicitly; an attention layer with no forward context at all raises."""

    def __repr__(self) -> str:
        return "DenseAttention()"


def dense_attention_context(vllm_config: Any = None) -> _ForwardContextScope:
    """`with dense_attention_context(): model(ids, positions)` = a plain causal forward."""
    return set_forward_context(DenseAttention(), vllm_config)


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("get_forward_context() called outside set_forward_context(...); "
                           "wrap the model forward in `with set_forward_context(attn_metadata):`.")
    return _current


def is_forward_context_available() -> bool:
    return _current is not None
