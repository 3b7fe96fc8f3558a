"""Multi-head latent attention (DeepSeek MLA) as one module.

Per token: c_kv = RMSNorm(kv_a(x)[:512]), k_pe = rope(kv_a(x)[512:]); the paged cache stores
[c_kv | k_pe] (576). Queries: q = q_proj(x) (or q_b(RMSNorm(q_a(x)))) split per head into
[q_nope | q_pe].

* Prefill rows (query longer than the builder's reorder_batch_threshold, with or without cached
  context) use the expanded form: K/V per head from kv_b_proj(c_kv); causal over the new tokens
  plus the cached context in bounded chunks, merged by LSE (backends/mla/prefill.py).
* Decode rows (query length <= reorder_batch_threshold) use the absorbed form: W_UK folded into q
  ([q_nope W_UK | q_pe], 576 wide), the backend attends over the latent cache, W_UV applied to its
  512-wide output. Under DCP the absorbed q is gathered over the DCP group along heads, each rank
  attends over its KV shard, and the partial outputs are merged by LSE and scattered back.
  A layer with `dcp_sharded = False` (a replicated drafter under a DCP target) keeps the whole
  context in its own cache on every rank and attends its own heads locally: no gather, no merge.
Both forms give the same q.k, so the same softmax scale (with DeepSeek's YaRN mscale) applies.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from vllm.model_executor.layers.parallel_utils import SingleRankGroup, dcp_group, divide, tp_group
from vllm.model_executor.layers.rotary_embedding import get_rope, yarn_softmax_scale_factor


def current_attn_metadata(layer_name: str):
    """This layer's metadata from the forward context, or None for an explicit dense-attention
    context (`vllm.forward_context.dense_attention_context()`: one causal sequence, no cache).

    No forward context is an error: silently running dense attention there would hide a step
    that forgot its metadata (and attend over the wrong tokens)."""
    from vllm.forward_context import DenseAttention, is_forward_context_available
    if not is_forward_context_available():
        raise RuntimeError(
            f"attention layer {layer_name!r} ran outside a forward context. The engine sets one "
            "per step (set_forward_context(attn_metadata)); for a plain causal forward over one "
            "sequence (oracles, training) wrap the call in "
            "`with vllm.forward_context.dense_attention_context():`.")
    from vllm.forward_context import get_forward_context
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, DenseAttention):
        return None
    if metadata is None:
        raise RuntimeError(
            f"attention layer {layer_name!r}: the forward context carries no attention metadata; "
            "build it with build_attn_metadata, or use dense_attention_context() on purpose.")
    if isinstance(metadata, dict):
        if layer_name not in metadata:
            raise KeyError(
                f"forward context has attention metadata for {sorted(metadata)[:4]}... but not for "
                f"layer {layer_name!r}; build metadata for every layer of its KV cache group"
            )
        return metadata[layer_name]
    return metadata


class MLAAttention(nn.Module):
    def __init__(self, config, *, layer_name: str, attention_backend: str | None = "auto",
                 non_causal: bool = False):
        super().__init__()
        self.layer_name = layer_name
        self.non_causal = non_causal
        self.attention_backend_name = attention_backend
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.tp_size = tp_group().world_size
        self.num_local_heads = divide(self.num_heads, self.tp_size, "num_attention_heads")
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        bias = bool(config.attention_bias)

        if self.q_lora_rank is not None:
            self.q_a_proj = ReplicatedLinear(self.hidden_size, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)  # DeepSeek uses eps 1e-6 here
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, self.num_heads * self.qk_head_dim)
        else:
            self.q_proj = ColumnParallelLinear(self.hidden_size, self.num_heads * self.qk_head_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(self.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim,
                                                   bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank,
                                              self.num_heads * (self.qk_nope_head_dim + self.v_head_dim))
        self.o_proj = RowParallelLinear(self.num_heads * self.v_head_dim, self.hidden_size, bias=bias)
        self.rotary_emb = get_rope(config)
        self.scaling = self.qk_head_dim ** -0.5 * yarn_softmax_scale_factor(config)

        self.kv_cache: torch.Tensor | None = None  # [num_blocks, block_size, 576], bound by the runner
        # False: this layer's KV is replicated over the DCP group (full context on every rank);
        # set before get_kv_cache_spec() / bind_attention_backend() (draft_parallel.py).
        self.dcp_sharded = True
        self._backend = None
        self._impl = None

    # ---- KV cache interface -------------------------------------------------------------------
    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype):
        from vllm.v1.kv_cache_interface import MLAAttentionSpec
        return MLAAttentionSpec(block_size=block_size, num_kv_heads=1,
                                head_size=self.kv_lora_rank + self.qk_rope_head_dim, dtype=dtype,
                                non_causal_multi_token_decode=self.non_causal,
                                dcp_sharded=self.dcp_sharded)

    # ---- projections shared by all paths --------------------------------------------------------
    def project_q(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_nope [T, H_local, nope], un-rotated q_pe [T, H_local, 64]); `positions` is unused
        (rope is applied with the KV write, `rope_and_write_kv`, or by `rotary_emb`)."""
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(-1, self.num_local_heads, self.qk_head_dim)
        return q[..., : self.qk_nope_head_dim], q[..., self.qk_nope_head_dim:]

    def project_latent_kv(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed c_kv [T, 512], un-rotated k_pe [T, 64]) of the tokens `x`."""
        kv = self.kv_a_proj_with_mqa(x)
        kv_c, k_pe = kv.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        return self.kv_a_layernorm(kv_c), k_pe

    def rotated_latent_kv(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Exactly what the cache stores for tokens `x` at `positions`: (c_kv, rope(k_pe)).
        Same rope code as the fused write (`rope_concat_and_cache_mla`), so the values agree bit
        for bit with what `forward` stores."""
        from vllm.v1.attention.ops.mla_kv_cache import rope_concat_and_cache_mla
        kv_c, k_pe = self.project_latent_kv(positions, x)
        dummy_q = k_pe.new_empty(k_pe.shape[0], 0, self.qk_rope_head_dim)
        k_rot = torch.empty(k_pe.shape, dtype=k_pe.dtype, device=k_pe.device)
        rope = self.rotary_emb
        rope_concat_and_cache_mla(positions, dummy_q, k_pe, kv_c, rope.cos_cache, rope.sin_cache,
                                  rope.interleaved, None, None, k_pe_out=k_rot)
        return kv_c, k_rot

    def _need_kv_cache(self) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError(f"layer {self.layer_name!r} has no kv_cache bound; the runner must "
                               "set layer.kv_cache before a step with attention metadata")
        return self.kv_cache

    def write_kv(self, kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store already-rotated latents (slots -1 and tokens past the mapping are skipped)."""
        kv_cache = self._need_kv_cache()
        from vllm.v1.attention.ops.mla_kv_cache import concat_and_cache_mla
        n = min(kv_c.shape[0], slot_mapping.shape[0])
        concat_and_cache_mla(kv_c[:n], k_pe[:n], kv_cache, slot_mapping[:n])

    def write_latent_kv(self, positions: torch.Tensor, x: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
        """Project, rotate and store the latent KV of tokens `x` at `positions` in one fused
        rope + write (no rotated copy, no query heads): what rotated_latent_kv + write_kv
        store, with one launch and one buffer fewer. The block drafters' context-KV write runs
        this for every draft layer inside every target step, drafting or not."""
        from vllm.v1.attention.ops.mla_kv_cache import rope_concat_and_cache_mla
        kv_cache = self._need_kv_cache()
        kv_c, k_pe = self.project_latent_kv(positions, x)
        n = min(kv_c.shape[0], slot_mapping.shape[0])
        no_heads = k_pe.new_empty(n, 0, self.qk_rope_head_dim)
        rope = self.rotary_emb
        rope_concat_and_cache_mla(positions[:n], no_heads, k_pe[:n], kv_c[:n], rope.cos_cache,
                                  rope.sin_cache, rope.interleaved, kv_cache, slot_mapping[:n])

    def rope_and_write_kv(self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor,
                          kv_c: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One launch on CUDA: rope(q_pe), rope(k_pe), and [kv_c | rope(k_pe)] into the cache.
        Returns (rotated q_pe, rotated k_pe)."""
        kv_cache = self._need_kv_cache()
        from vllm.v1.attention.ops.mla_kv_cache import rope_concat_and_cache_mla
        k_rot = torch.empty(k_pe.shape, dtype=k_pe.dtype, device=k_pe.device)
        rope = self.rotary_emb
        q_rot = rope_concat_and_cache_mla(positions, q_pe, k_pe, kv_c, rope.cos_cache, rope.sin_cache,
                                          rope.interleaved, kv_cache, slot_mapping, k_pe_out=k_rot)
        return q_rot, k_rot

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q_nope, q_pe = self.project_q(positions, hidden_states)
        kv_c, k_pe = self.project_latent_kv(positions, hidden_states)
        num_tokens = hidden_states.shape[0]

        metadata = current_attn_metadata(self.layer_name)
        if metadata is None:
            # No paged cache this step: the batch is one sequence, attended in place.
            q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)
            q, k, v = self._expanded_qkv(q_nope, q_pe, kv_c, k_pe)
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                 is_causal=not self.non_causal, scale=self.scaling)
            out = out.transpose(0, 1)
        else:
            # rope + KV write before attention: rows see themselves
            q_pe, k_pe = self.rope_and_write_kv(positions, q_pe, k_pe, kv_c, metadata.slot_mapping)
            out = q_nope.new_zeros(num_tokens, self.num_local_heads, self.v_head_dim)
            num_decode = int(metadata.num_decode_tokens)
            if num_decode > 0:
                out[:num_decode] = self._forward_absorbed(q_nope[:num_decode], q_pe[:num_decode],
                                                          metadata.decode)
            if metadata.prefill is not None:
                # Prefill rows (with or without cached context): chunked, no L x L (prefill.py).
                from vllm.v1.attention.backends.mla.prefill import forward_mla_prefill
                end = num_decode + int(metadata.prefill.query_start_loc_cpu[-1])
                sl = slice(num_decode, end)
                out[sl] = forward_mla_prefill(self, q_nope[sl], q_pe[sl], kv_c[sl], k_pe[sl],
                                              metadata.prefill)
        return self.o_proj(out.reshape(num_tokens, self.num_local_heads * self.v_head_dim))

    def _kv_b_weight(self) -> torch.Tensor:
        # kv_b_proj rows are per head [W_UK (nope rows) | W_UV (v rows)], each row 512 wide.
        return self.kv_b_proj.weight.view(self.num_local_heads, self.qk_nope_head_dim + self.v_head_dim,
                                          self.kv_lora_rank)

    def _expanded_qkv(self, q_nope, q_pe, kv_c, k_pe):
        """Per-head q, k [T, H_local, nope+rope] and v [T, H_local, v] (the non-absorbed form)."""
        kv = self.kv_b_proj(kv_c).view(-1, self.num_local_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, self.num_local_heads, -1)], dim=-1)
        return q, k, v

    def attn_dcp_group(self):
        """The group this layer's KV is split over: the DCP group, or a one-rank stand-in when
        the layer's KV is replicated on every rank."""
        return dcp_group() if self.dcp_sharded else SingleRankGroup()

    def bind_attention_backend(self, backend) -> None:
        """Called by the model runner with the backend resolved once for this layer's KV cache
        group: the layer's impl must match the group's metadata builder."""
        # heads after the DCP q gather
        num_heads = self.num_local_heads * self.attn_dcp_group().world_size
        self._backend = backend
        self._impl = backend.get_impl_cls()(
            num_heads=num_heads, scale=self.scaling, kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim, qk_nope_head_dim=self.qk_nope_head_dim)

    def _attention_impl(self):
        if self._impl is None:
            # Stand-alone use (tests driving a model with hand-built metadata): resolve by name.
            from vllm.v1.attention.selector import get_attn_backend
            device = self.kv_cache.device if self.kv_cache is not None else None
            self.bind_attention_backend(get_attn_backend(self.attention_backend_name,
                                                         device=device))
        return self._backend, self._impl

    def _forward_absorbed(self, q_nope, q_pe, decode_metadata) -> torch.Tensor:
        backend, impl = self._attention_impl()
        w = self._kv_b_weight()
        w_uk, w_uv = w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]
        q_latent = torch.einsum("thn,hnc->thc", q_nope, w_uk)
        q = torch.cat([q_latent, q_pe], dim=-1)  # [T, H_local, 576]
        dcp = self.attn_dcp_group()
        if dcp.world_size > 1:
            from vllm.v1.attention.ops.dcp_combine import cp_lse_ag_out_rs, dcp_all_gather_q
            q = dcp_all_gather_q(q.contiguous(), dcp)
            o, lse = impl.forward_decode(q, self.kv_cache, decode_metadata)
            o = cp_lse_ag_out_rs(o, lse, dcp, lse_base_on_e=backend.lse_base_on_e)
        else:
            o, _ = impl.forward_decode(q, self.kv_cache, decode_metadata)
        return torch.einsum("thc,hvc->thv", o.to(q_nope.dtype), w_uv)
