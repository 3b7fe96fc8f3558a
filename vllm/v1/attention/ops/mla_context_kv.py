"""The block drafters' context-KV write for several MLA layers in one launch.

A block drafter (DFlash, DSpark) stores, in every target step, each draft layer's latent KV of
the step's tokens: c_kv = RMSNorm(kv_a(x)[:512]) and rope(kv_a(x)[512:]) into that layer's
paged cache. Per layer that was a GEMM, an RMSNorm launch and a rope + cache-write launch, all
inside the target step's graph whether or not anybody drafts after it (tiny model, H200: the
context-KV write was most of the ~4 % by which a DSpark engine that never drafts trails plain
decoding; docs/performance.md, fourteenth session). The caller now runs ONE GEMM over all
layers' stacked kv_a weights (mla_context_kv_writer.py) and this op does every layer's norm,
rope and cache write in one launch per MAX_LAYERS_PER_LAUNCH layers: one program per token,
which loads the token's position and rope table row once and then, per layer, normalises that
layer's 512 latent values and rotates its 64 rope values straight from the GEMM's output row.

Same arithmetic as the per-layer path (layernorm.py's RMSNorm kernel: float32 sum of squares,
Hugging Face's rounding order; mla_kv_cache.py's rope), so from the same GEMM output the cache
rows are bit-identical; slots -1 and tokens past a layer's slot mapping store nothing. CUDA
only (Triton); the caller keeps the per-layer path elsewhere.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm.model_executor.layers.rotary_embedding import HAS_TRITON

MAX_LAYERS_PER_LAUNCH = 4  # pointer arguments per launch (a DSpark drafter has 1-3 layers)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from vllm.model_executor.layers.rotary_embedding import rope_offsets, rope_pairs

    @triton.jit
    def _norm_rope_store(src, w_ptr, cache_ptr, cache_st, slot_ptr, num_slots, t, eps, cos, sin,
                         d1, d2, dmask, KV_LORA: tl.constexpr, BLOCK_KV: tl.constexpr):
        slot = tl.load(slot_ptr + t, mask=t < num_slots, other=-1).to(tl.int64)
        if slot >= 0:
            c = tl.arange(0, BLOCK_KV)
            cmask = c < KV_LORA
            x = tl.load(src + c, mask=cmask, other=0.0)
            xf = x.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / KV_LORA + eps)
            y = (xf * rstd).to(x.dtype)  # Hugging Face casts back before the weight multiply
            w = tl.load(w_ptr + c, mask=cmask, other=0.0)
            normed = (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype)
            k1, k2 = rope_pairs(src + KV_LORA, d1, d2, cos, sin, dmask)
            row = cache_ptr + slot * cache_st
            dtype = cache_ptr.dtype.element_ty
            tl.store(row + c, normed.to(dtype), mask=cmask)
            tl.store(row + KV_LORA + d1, k1.to(dtype), mask=dmask)
            tl.store(row + KV_LORA + d2, k2.to(dtype), mask=dmask)

    @triton.jit
    def _context_kv_kernel(
            kv_ptr, kv_st, pos_ptr, cos_ptr, sin_ptr, table_stride, num_positions, eps,
            w0, c0, cs0, s0, n0, w1, c1, cs1, s1, n1, w2, c2, cs2, s2, n2, w3, c3, cs3, s3, n3,
            LAYER_WIDTH: tl.constexpr, KV_LORA: tl.constexpr, BLOCK_KV: tl.constexpr,
            HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
            NUM_LAYERS: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        i, d1, d2, dmask = rope_offsets(HALF, BLOCK_HALF, INTERLEAVED)
        # (clamped: a padding token's position may be anything, and nothing of it is stored)
        pos = tl.minimum(tl.maximum(tl.load(pos_ptr + t).to(tl.int64), 0), num_positions - 1)
        cos = tl.load(cos_ptr + pos * table_stride + i, mask=dmask, other=0.0)
        sin = tl.load(sin_ptr + pos * table_stride + i, mask=dmask, other=0.0)
        src = kv_ptr + t * kv_st
        _norm_rope_store(src, w0, c0, cs0, s0, n0, t, eps, cos, sin, d1, d2, dmask,
                         KV_LORA, BLOCK_KV)
        if NUM_LAYERS > 1:
            _norm_rope_store(src + LAYER_WIDTH, w1, c1, cs1, s1, n1, t, eps, cos, sin, d1, d2,
                             dmask, KV_LORA, BLOCK_KV)
        if NUM_LAYERS > 2:
            _norm_rope_store(src + 2 * LAYER_WIDTH, w2, c2, cs2, s2, n2, t, eps, cos, sin, d1,
                             d2, dmask, KV_LORA, BLOCK_KV)
        if NUM_LAYERS > 3:
            _norm_rope_store(src + 3 * LAYER_WIDTH, w3, c3, cs3, s3, n3, t, eps, cos, sin, d1,
                             d2, dmask, KV_LORA, BLOCK_KV)


def write_context_kv_layers(kv: torch.Tensor, norm_weights: Sequence[torch.Tensor], eps: float,
                            positions: torch.Tensor, cos_cache: torch.Tensor,
                            sin_cache: torch.Tensor, interleaved: bool,
                            kv_caches: Sequence[torch.Tensor],
                            slot_mappings: Sequence[torch.Tensor], kv_lora_rank: int) -> None:
    """kv [T, L * (kv_lora + rope)]: layer l's un-normed [c_kv | k_pe] in columns l * W ...
    (l + 1) * W (one GEMM over the stacked kv_a weights). Stores layer l's [RMSNorm(c_kv) |
    rope(k_pe)] into kv_caches[l] [blocks, block_size, W] at slot_mappings[l]; slots -1 and
    tokens past a mapping are skipped. Device ops only (capturable)."""
    num_layers = len(norm_weights)
    if not (len(kv_caches) == len(slot_mappings) == num_layers) or num_layers == 0:
        raise ValueError(f"write_context_kv_layers: {num_layers} norm weights, {len(kv_caches)} "
                         f"caches and {len(slot_mappings)} slot mappings; pass one of each per "
                         "layer")
    width = kv.shape[-1] // num_layers
    rope_dim = width - kv_lora_rank
    if kv.shape[-1] != num_layers * width or rope_dim <= 0 or rope_dim % 2:
        raise ValueError(f"write_context_kv_layers: kv is {tuple(kv.shape)} for {num_layers} "
                         f"layers of kv_lora_rank {kv_lora_rank}; each layer needs "
                         "kv_lora_rank + an even rope width")
    for cache in kv_caches:
        if cache.shape[-1] != width or not cache.is_contiguous():
            raise ValueError(f"write_context_kv_layers: a cache of shape {tuple(cache.shape)} "
                             f"for rows of {width}; pass contiguous [blocks, block_size, "
                             f"{width}] caches")
    num_tokens = kv.shape[0]
    if positions.shape[0] < num_tokens:
        raise ValueError(f"write_context_kv_layers: {num_tokens} tokens but "
                         f"{positions.shape[0]} positions; pass one position per token")
    if not num_tokens:
        return
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    positions = positions.contiguous()
    half = rope_dim // 2
    for start in range(0, num_layers, MAX_LAYERS_PER_LAUNCH):
        group = range(start, min(start + MAX_LAYERS_PER_LAUNCH, num_layers))
        args = []
        for j in range(MAX_LAYERS_PER_LAUNCH):
            layer = group[j] if j < len(group) else group[0]  # unused slots repeat layer 0
            flat = kv_caches[layer].view(-1, width)
            slots = slot_mappings[layer]
            if slots.stride(-1) != 1:
                slots = slots.contiguous()
            args += [norm_weights[layer], flat, flat.stride(0), slots, slots.shape[0]]
        _context_kv_kernel[(num_tokens,)](
            kv[:, start * width:], kv.stride(0), positions, cos_cache, sin_cache,
            cos_cache.stride(0), cos_cache.shape[0], float(eps), *args,
            LAYER_WIDTH=width, KV_LORA=kv_lora_rank,
            BLOCK_KV=triton.next_power_of_2(kv_lora_rank), HALF=half,
            BLOCK_HALF=triton.next_power_of_2(half), INTERLEAVED=bool(interleaved),
            NUM_LAYERS=len(group), num_warps=4)
