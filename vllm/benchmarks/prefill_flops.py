"""FLOP and memory arithmetic of a DeepSeek (MLA) prefill, for benchmarks/engine/benchmark_prefill.py.

Conventions (stated in the benchmark's output too):
  * one multiply-add = 2 FLOPs;
  * attention FLOPs of a causal prefill of L tokens, per layer per head: QK^T and PV over the
    L(L+1)/2 visible (query, key) pairs, 2 * L(L+1)/2 * (d_qk + d_v) with d_qk = nope + rope = 192
    and d_v = 128 on DeepSeek-V3 (~ L^2 * 320). Chunking does not change the count: a chunk
    [s, e) sees its s context tokens fully and itself causally, and the chunks tile the triangle;
  * matmul FLOPs: 2 * (weights one token multiplies) per prompt token (routed experts at
    top-k / n_routed of their weights), plus the LM head once per request (only the last prompt
    position is sampled). Useful work only: the context passes' re-expansion of cached latents
    through kv_b_proj (an implementation cost of chunked prefill) is not counted.
"""
from __future__ import annotations

from typing import Any

# H200 (SXM) dense bf16 tensor-core peak, no sparsity (NVIDIA datasheet: 989 TFLOP/s).
H200_BF16_DENSE_PEAK_TFLOPS = 989.0

ATTENTION_FLOPS_FORMULA = ("attention FLOPs = layers * heads * 2 * L(L+1)/2 * (d_qk + d_v), "
                           "d_qk = qk_nope + qk_rope, d_v = v_head_dim (QK^T and PV over the "
                           "causal pairs)")
MATMUL_FLOPS_FORMULA = ("matmul FLOPs = 2 * L * (per-token linear weights, routed experts at "
                        "top-k / n_routed) + 2 * hidden * vocab (LM head, last token)")


def _get(config: Any, name: str, default=None):
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def head_dims(config: Any) -> tuple[int, int]:
    """(d_qk, d_v) of the expanded MLA prefill form."""
    return (int(_get(config, "qk_nope_head_dim")) + int(_get(config, "qk_rope_head_dim")),
            int(_get(config, "v_head_dim")))


def causal_pairs(num_tokens: int, context: int = 0) -> int:
    """(query, key) pairs that `num_tokens` new tokens see after `context` cached tokens."""
    return num_tokens * context + num_tokens * (num_tokens + 1) // 2


def attention_flops(config: Any, num_tokens: int, context: int = 0) -> int:
    """Attention FLOPs over all layers and heads of prefilling `num_tokens` after `context`."""
    d_qk, d_v = head_dims(config)
    layers, heads = int(_get(config, "num_hidden_layers")), int(_get(config, "num_attention_heads"))
    return layers * heads * 2 * causal_pairs(num_tokens, context) * (d_qk + d_v)


def attention_flops_one_layer(num_heads: int, d_qk: int, d_v: int, num_tokens: int,
                              context: int = 0) -> int:
    return num_heads * 2 * causal_pairs(num_tokens, context) * (d_qk + d_v)


def _uses_moe(config: Any, layer: int) -> bool:
    n_routed = _get(config, "n_routed_experts")
    return (n_routed is not None and layer >= int(_get(config, "first_k_dense_replace", 0))
            and layer % int(_get(config, "moe_layer_freq", 1)) == 0)


def linear_weights_per_token(config: Any) -> float:
    """Weights one token multiplies through the decoder layers (no embedding, no LM head)."""
    hidden = int(_get(config, "hidden_size"))
    heads = int(_get(config, "num_attention_heads"))
    d_qk, d_v = head_dims(config)
    nope, rope = int(_get(config, "qk_nope_head_dim")), int(_get(config, "qk_rope_head_dim"))
    kv_rank = int(_get(config, "kv_lora_rank"))
    q_rank = _get(config, "q_lora_rank")
    if q_rank:
        q = hidden * int(q_rank) + int(q_rank) * heads * d_qk
    else:
        q = hidden * heads * d_qk
    attn = q + hidden * (kv_rank + rope) + kv_rank * heads * (nope + d_v) + heads * d_v * hidden
    total = 0.0
    for layer in range(int(_get(config, "num_hidden_layers"))):
        if _uses_moe(config, layer):
            n_routed = int(_get(config, "n_routed_experts"))
            inter = int(_get(config, "moe_intermediate_size"))
            active = int(_get(config, "num_experts_per_tok")) + int(_get(config, "n_shared_experts") or 0)
            mlp = hidden * n_routed + active * 3 * hidden * inter   # router + gate/up/down
        else:
            mlp = 3 * hidden * int(_get(config, "intermediate_size"))
        total += attn + mlp
    return total


def matmul_flops(config: Any, num_tokens: int, num_requests: int = 1) -> float:
    lm_head = int(_get(config, "hidden_size")) * int(_get(config, "vocab_size"))
    return 2.0 * num_tokens * linear_weights_per_token(config) + 2.0 * num_requests * lm_head


def prefill_flops(config: Any, num_tokens: int) -> dict[str, float]:
    """Useful FLOPs of prefilling one prompt of `num_tokens` tokens (any chunking)."""
    attn = float(attention_flops(config, num_tokens))
    mm = matmul_flops(config, num_tokens)
    return {"attention": attn, "matmul": mm, "total": attn + mm}


def chunk_schedule(num_tokens: int, budget: int) -> list[tuple[int, int]]:
    """[(context, new tokens)] of a lone prompt prefilled under a per-step token budget."""
    return [(s, min(budget, num_tokens - s)) for s in range(0, num_tokens, budget)]


def planned_prefill_workspace_bytes(config: Any, budget: int, context_chunk_tokens: int,
                                    dtype_bytes: int = 2, flashinfer_workspace: int = 0) -> int:
    """Estimate of the transient memory of one prefill step of `budget` tokens whose context is
    read in passes of `context_chunk_tokens` tokens, at the layer that holds the most at once.

    Counted: the residual stream and its normed copy, the MLP's gate/up output and activation
    (or the routed experts' per-token-slot buffers), q / expanded k / v / output of the new tokens
    (+ fp32 O and LSE for the merge), one context pass (gathered latents, kv_b_proj output,
    K and V, fp32 partial O and LSE), the last position's fp32 logits, and the attention
    backend's fixed workspace. An estimate: the allocator's rounding and kernels' scratch add."""
    hidden = int(_get(config, "hidden_size"))
    heads = int(_get(config, "num_attention_heads"))
    d_qk, d_v = head_dims(config)
    nope = int(_get(config, "qk_nope_head_dim"))
    rank = int(_get(config, "kv_lora_rank")) + int(_get(config, "qk_rope_head_dim"))
    inter = int(_get(config, "intermediate_size"))
    if _get(config, "n_routed_experts") is not None:
        inter = max(inter, int(_get(config, "moe_intermediate_size")) *
                    (int(_get(config, "num_experts_per_tok")) + int(_get(config, "n_shared_experts") or 0)))
    t, n, b = budget, context_chunk_tokens, dtype_bytes
    stream = 3 * t * hidden * b
    mlp = t * 3 * inter * b
    new = t * heads * (2 * d_qk + 2 * d_v) * b + t * heads * (d_v + 1) * 4 * 2
    ctx = n * rank * b + n * heads * ((nope + d_v) + d_qk + d_v) * b + t * heads * (d_v + 1) * 4
    logits = int(_get(config, "vocab_size")) * 4
    return int(stream + max(mlp, new + ctx) + logits + flashinfer_workspace)
