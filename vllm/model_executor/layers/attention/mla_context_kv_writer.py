"""All of a block drafter's layers' context-KV writes as one GEMM and one launch.

`MLAAttention.write_latent_kv` per draft layer is a GEMM (kv_a), an RMSNorm launch and a rope +
cache-write launch; a block drafter runs it for every layer inside every target step, drafting
or not (dflash_mla.py `precompute_context_kv`). `ContextKVWriter` stacks the layers' kv_a
weights into one [L * 576, hidden] matrix, once, and re-points every layer's weight at its
rows of it (views: no second copy of the weights, and a later weight load, which copies into
the parameter, updates the stack too); a step then runs one GEMM over the stack and
`write_context_kv_layers` (v1/attention/ops/mla_context_kv.py) for the norms, ropes and cache
writes. 3 L launches become 2 (1 + ceil(L / 4)).

Used only where it computes exactly what the per-layer path does, and otherwise not at all (the
reason is kept in `reason`): CUDA with Triton, unquantised kv_a projections of one dtype, biases
on all or none, norm weights of that dtype with one eps, one rope (float32 tables, equal in
every layer). The stacked GEMM may pick another cuBLAS kernel than the per-layer ones, so the
cache's low-order bits can differ from the per-layer path's; drafts are verified, so greedy
output never depends on them. VLLM_FUSED_DRAFT_CONTEXT_KV=0 keeps the per-layer path (A/B).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from vllm.utils.env_flags import switch_flag

ENV_FLAG = "VLLM_FUSED_DRAFT_CONTEXT_KV"
logger = logging.getLogger(__name__)


def fused_context_kv_enabled() -> bool:
    return switch_flag(ENV_FLAG, True, "one GEMM and one launch for all draft layers' "
                       "context-KV writes where exact", "per layer")


class ContextKVWriter:
    """Per block drafter: the stacked kv_a weights of its layers and the fused write."""

    def __init__(self, attentions: Sequence[torch.nn.Module], cuda_only: bool = True,
                 enabled: bool | None = None):
        self.attentions = list(attentions)
        # None: the flag as it is now (the drafter passes what it read when it was built)
        self.enabled = fused_context_kv_enabled() if enabled is None else bool(enabled)
        # False only for Triton's CPU interpreter (tests/utils/triton_fused_ops_interpret_driver.py)
        self.cuda_only = cuda_only
        self.reason: str | None = None  # why the fused path is not used (None: not judged yet)
        self._weight: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        self._params: tuple = ()
        self._ptrs: tuple = ()
        self._built = False
        self._usable = False

    # ---- eligibility and the stacked weights ----------------------------------------------------
    def _ineligible(self, reason: str) -> bool:
        self.reason, self._usable, self._built = reason, False, True
        logger.info("block drafter context-KV write: per layer (%s)", reason)
        return False

    def _build(self, features: torch.Tensor) -> bool:
        from vllm.model_executor.layers.rotary_embedding import HAS_TRITON, use_triton_rope
        attns = self.attentions
        if not self.enabled:
            return self._ineligible(f"{ENV_FLAG}=0")
        if not attns:
            return self._ineligible("no layers")
        if not (HAS_TRITON and (features.is_cuda or not self.cuda_only)):
            return self._ineligible("not CUDA with Triton")
        projs = [a.kv_a_proj_with_mqa for a in attns]
        if any(p.quant_method is not None for p in projs):
            return self._ineligible("a quantised kv_a projection")
        first = projs[0].weight
        if any(p.weight.dtype != first.dtype or p.weight.device != first.device
               or p.weight.shape != first.shape for p in projs):
            return self._ineligible("kv_a weights of different dtypes, devices or shapes")
        if len({p.bias is None for p in projs}) != 1:
            return self._ineligible("biases on some kv_a projections only")
        norms = [a.kv_a_layernorm for a in attns]
        if any(n.weight.dtype != first.dtype for n in norms):
            return self._ineligible("a norm weight dtype other than the kv_a weights'")
        if len({float(n.variance_epsilon) for n in norms}) != 1:
            return self._ineligible("norms with different eps")
        if len({(a.kv_lora_rank, a.qk_rope_head_dim) for a in attns}) != 1:
            return self._ineligible("layers of different latent widths")
        ropes = [a.rotary_emb for a in attns]
        rope = ropes[0]
        if (rope.cos_cache.dtype != torch.float32 or features.dtype == torch.float64
                or (self.cuda_only and not use_triton_rope(features, rope.cos_cache))):
            return self._ineligible("rope tables that the Triton rope does not take")
        for other in ropes[1:]:
            if (other.interleaved != rope.interleaved
                    or other.cos_cache.shape != rope.cos_cache.shape
                    or other.cos_cache.dtype != rope.cos_cache.dtype):
                return self._ineligible("layers with different ropes")
            # (one device comparison, once, never inside a capture: see usable)
            if not (torch.equal(other.cos_cache, rope.cos_cache)
                    and torch.equal(other.sin_cache, rope.sin_cache)):
                return self._ineligible("layers with different rope tables")
        with torch.no_grad():
            weight = torch.cat([p.weight.data for p in projs], dim=0)
            bias = None if projs[0].bias is None else torch.cat([p.bias.data for p in projs])
            rows = first.shape[0]
            for i, p in enumerate(projs):  # each layer's weight becomes its rows of the stack
                p.weight.data = weight[i * rows:(i + 1) * rows]
                if bias is not None:
                    p.bias.data = bias[i * rows:(i + 1) * rows]
        self._weight, self._bias = weight, bias
        self._params = tuple(p.weight for p in projs) + tuple(
            () if bias is None else (p.bias for p in projs))
        self._ptrs = tuple(t.data_ptr() for t in self._params)
        self.reason, self._usable, self._built = None, True, True
        logger.info("block drafter context-KV write: fused (%d layers, one GEMM over the "
                    "stacked kv_a weights, %d launch(es))", len(attns),
                    -(-len(attns) // 4))
        return True

    def usable(self, features: torch.Tensor) -> bool:
        """Whether `write` may take these features (judged once; the stack is checked to still
        back every layer's weight, so a weight replaced later turns the fused path off)."""
        if not self._built:
            if features.is_cuda and torch.cuda.is_current_stream_capturing():
                # The stack is a persistent weight: never allocated from a graph's private
                # pool, and the rope tables are compared with a sync. The engine's memory
                # profile runs a step eagerly first; a capture before any eager step keeps
                # the per-layer path in its graph (exact, only slower) and judges later.
                return False
            return self._build(features)
        if not self._usable:
            return False
        if tuple(t.data_ptr() for t in self._params) != self._ptrs:
            return self._ineligible("a kv_a weight no longer in the stack (replaced after the "
                                    "first step)")
        return features.dtype == self._weight.dtype and features.device == self._weight.device

    # ---- the write ------------------------------------------------------------------------------
    def write(self, positions: torch.Tensor, features: torch.Tensor,
              slot_mappings: Sequence[torch.Tensor]) -> None:
        """Every layer's latent KV of tokens `features` [T, hidden] at `positions` [T] into
        its bound cache at its slot mapping (what write_latent_kv per layer stores)."""
        from vllm.v1.attention.ops.mla_context_kv import write_context_kv_layers
        attns = self.attentions
        kv = F.linear(features, self._weight, self._bias)
        first = attns[0]
        rope = first.rotary_emb
        write_context_kv_layers(
            kv, [a.kv_a_layernorm.weight for a in attns], first.kv_a_layernorm.variance_epsilon,
            positions, rope.cos_cache, rope.sin_cache, rope.interleaved,
            [a._need_kv_cache() for a in attns], slot_mappings, first.kv_lora_rank)
