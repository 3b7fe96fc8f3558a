"""Write the MLA latent ([c_kv | k_pe]) of new tokens into the paged cache, optionally fused with
the rotary embedding of q_pe and k_pe.

Slots equal to -1 are skipped: under DCP another rank stores that token (PAD), and CUDA-graph
padding tokens carry -1 too. On CUDA both ops are one Triton launch (one program per token; a
program whose slot is -1 simply stores nothing), so they never sync with the host and can be
captured in a CUDA graph. Elsewhere they are plain torch with the same results.
"""
from __future__ import annotations

import torch

from vllm.model_executor.layers.rotary_embedding import (HAS_TRITON, check_positions, rope_torch,
                                                         use_triton_rope)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from vllm.model_executor.layers.rotary_embedding import rope_offsets, rope_pairs

    @triton.jit
    def _rope_concat_cache_kernel(
            pos_ptr, cos_ptr, sin_ptr, table_stride,
            q_ptr, q_st, q_sh, qo_ptr, qo_st, qo_sh, num_heads,
            kpe_ptr, kpe_st, kvc_ptr, kvc_st, ko_ptr, ko_st,
            cache_ptr, cache_st, slot_ptr, num_slots,
            KV_LORA: tl.constexpr, BLOCK_KV: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
            BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, ROTATE: tl.constexpr, HAS_Q: tl.constexpr,
            HAS_K_OUT: tl.constexpr, WRITE_CACHE: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        i, d1, d2, dmask = rope_offsets(HALF, BLOCK_HALF, INTERLEAVED)
        if ROTATE:
            pos = tl.load(pos_ptr + t).to(tl.int64)
            cos = tl.load(cos_ptr + pos * table_stride + i, mask=dmask, other=0.0)
            sin = tl.load(sin_ptr + pos * table_stride + i, mask=dmask, other=0.0)
            if HAS_Q:
                h = tl.arange(0, BLOCK_H)
                qmask = (h < num_heads)[:, None] & dmask[None, :]
                q1, q2 = rope_pairs(q_ptr + t * q_st + h[:, None] * q_sh, d1[None, :], d2[None, :],
                                    cos[None, :], sin[None, :], qmask)
                q_out = qo_ptr + t * qo_st + h[:, None] * qo_sh
                tl.store(q_out + d1[None, :], q1.to(qo_ptr.dtype.element_ty), mask=qmask)
                tl.store(q_out + d2[None, :], q2.to(qo_ptr.dtype.element_ty), mask=qmask)
            k1, k2 = rope_pairs(kpe_ptr + t * kpe_st, d1, d2, cos, sin, dmask)
        else:
            k1 = tl.load(kpe_ptr + t * kpe_st + d1, mask=dmask, other=0.0)
            k2 = tl.load(kpe_ptr + t * kpe_st + d2, mask=dmask, other=0.0)
        if HAS_K_OUT:
            tl.store(ko_ptr + t * ko_st + d1, k1.to(ko_ptr.dtype.element_ty), mask=dmask)
            tl.store(ko_ptr + t * ko_st + d2, k2.to(ko_ptr.dtype.element_ty), mask=dmask)
        if WRITE_CACHE:
            # tokens past the slot mapping have no slot, like slot -1 (nothing is stored)
            slot = tl.load(slot_ptr + t, mask=t < num_slots, other=-1).to(tl.int64)
            if slot >= 0:
                row = cache_ptr + slot * cache_st
                c = tl.arange(0, BLOCK_KV)
                kv = tl.load(kvc_ptr + t * kvc_st + c, mask=c < KV_LORA, other=0.0)
                tl.store(row + c, kv.to(cache_ptr.dtype.element_ty), mask=c < KV_LORA)
                tl.store(row + KV_LORA + d1, k1.to(cache_ptr.dtype.element_ty), mask=dmask)
                tl.store(row + KV_LORA + d2, k2.to(cache_ptr.dtype.element_ty), mask=dmask)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_cache_args(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, op: str) -> None:
    width = kv_c.shape[-1] + k_pe.shape[-1]
    if kv_cache.shape[-1] != width:
        raise ValueError(f"{op}: cache last dim {kv_cache.shape[-1]} != "
                         f"kv_c {kv_c.shape[-1]} + k_pe {k_pe.shape[-1]}.")
    num_tokens = slot_mapping.shape[0]
    if kv_c.shape[0] < num_tokens or k_pe.shape[0] < num_tokens:
        raise ValueError(f"{op}: {num_tokens} slots but kv_c has "
                         f"{kv_c.shape[0]} and k_pe {k_pe.shape[0]} tokens.")
    if slot_mapping.is_floating_point():
        raise ValueError(f"{op}: slot_mapping has dtype {slot_mapping.dtype}; pass integer slots.")


def _concat_and_cache_torch(kv_c, k_pe, kv_cache, slot_mapping) -> None:
    num_tokens = slot_mapping.shape[0]
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    latent = torch.cat([kv_c[:num_tokens], k_pe[:num_tokens]], dim=-1).to(kv_cache.dtype)
    # Boolean selection (a host sync) is fine off CUDA; it keeps PAD tokens out entirely.
    flat.index_copy_(0, slots[keep], latent[keep])


def _launch(num_tokens, *, kv_c, k_pe, kv_cache, slot_mapping, positions=None, cos_cache=None,
            sin_cache=None, interleaved=False, q_pe=None, q_out=None, k_out=None) -> None:
    if not num_tokens:
        return
    rotate = positions is not None
    # the kernel reads positions[t] and slot_mapping[t] at offset t (no copy when already contiguous)
    positions = positions.contiguous() if rotate else None
    slot_mapping = slot_mapping.contiguous() if slot_mapping is not None else None
    kpe = _last_dim_contiguous(k_pe.reshape(k_pe.shape[0], k_pe.shape[-1]))
    half = kpe.shape[-1] // 2
    write = kv_cache is not None
    flat = kv_cache.view(-1, kv_cache.shape[-1]) if write else kpe
    kvc = _last_dim_contiguous(kv_c) if write else kpe
    kv_lora = kvc.shape[-1] if write else 1
    has_q = q_pe is not None and q_pe.shape[1] > 0
    q = q_pe if has_q else kpe
    qo = q_out if has_q else kpe
    num_heads = q_pe.shape[1] if has_q else 0
    ko = k_out if k_out is not None else kpe
    table = cos_cache if rotate else kpe
    _rope_concat_cache_kernel[(num_tokens,)](
        positions if rotate else kpe, table, sin_cache if rotate else kpe, table.stride(0),
        q, q.stride(0), q.stride(1) if has_q else 0, qo, qo.stride(0), qo.stride(1) if has_q else 0, num_heads,
        kpe, kpe.stride(0), kvc, kvc.stride(0), ko, ko.stride(0),
        flat, flat.stride(0), slot_mapping if write else kpe, slot_mapping.shape[0] if write else 0,
        KV_LORA=kv_lora, BLOCK_KV=triton.next_power_of_2(kv_lora), HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_H=triton.next_power_of_2(max(num_heads, 1)),
        INTERLEAVED=bool(interleaved), ROTATE=rotate, HAS_Q=has_q, HAS_K_OUT=k_out is not None,
        WRITE_CACHE=write, num_warps=4 if num_heads <= 32 else 8)


def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    """kv_c [T, 512], k_pe [T, 64] -> kv_cache [blocks, block_size, 576] at `slot_mapping` [T].

    Slots equal to -1 are skipped."""
    _check_cache_args(kv_c, k_pe, kv_cache, slot_mapping, "concat_and_cache_mla")
    if HAS_TRITON and kv_cache.is_cuda:
        _launch(slot_mapping.shape[0], kv_c=kv_c, k_pe=k_pe, kv_cache=kv_cache, slot_mapping=slot_mapping)
    else:
        _concat_and_cache_torch(kv_c, k_pe, kv_cache, slot_mapping)


def rope_concat_and_cache_mla(positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor,
                              kv_c: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                              interleaved: bool, kv_cache: torch.Tensor | None,
                              slot_mapping: torch.Tensor | None,
                              k_pe_out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate q_pe [T, H, 64] and k_pe [T, 64] (un-rotated) at `positions` [T] and write
    [kv_c | rope(k_pe)] (kv_c [T, 512], already normed) to kv_cache at `slot_mapping`.

    Returns the rotated q_pe (a new [T, H, 64] tensor). Slots -1 and tokens past the end of
    `slot_mapping` are not stored. `k_pe_out` [T, 64], when given, receives rope(k_pe) too (the
    expanded prefill form needs it). kv_cache=None, slot_mapping=None: rotate only.
    """
    if (kv_cache is None) != (slot_mapping is None):
        raise ValueError("rope_concat_and_cache_mla: pass kv_cache and slot_mapping together (or neither)")
    num_tokens = q_pe.shape[0]
    if k_pe.shape[0] != num_tokens or positions.shape[0] != num_tokens:
        raise ValueError(f"rope_concat_and_cache_mla: q_pe has {num_tokens} tokens, k_pe {k_pe.shape[0]}, "
                         f"positions {positions.shape[0]}; pass the same tokens")
    if kv_cache is not None:
        slot_mapping = slot_mapping[:num_tokens]
        _check_cache_args(kv_c, k_pe, kv_cache, slot_mapping, "rope_concat_and_cache_mla")
    if k_pe_out is not None and tuple(k_pe_out.shape) != (num_tokens, k_pe.shape[-1]):
        raise ValueError(f"rope_concat_and_cache_mla: k_pe_out shape {tuple(k_pe_out.shape)} != "
                         f"{(num_tokens, k_pe.shape[-1])}")
    if use_triton_rope(q_pe, cos_cache):
        q_pe = _last_dim_contiguous(q_pe)
        q_out = torch.empty(q_pe.shape, dtype=q_pe.dtype, device=q_pe.device)
        _launch(num_tokens, kv_c=kv_c, k_pe=k_pe, kv_cache=kv_cache, slot_mapping=slot_mapping,
                positions=positions, cos_cache=cos_cache, sin_cache=sin_cache, interleaved=interleaved,
                q_pe=q_pe, q_out=q_out, k_out=k_pe_out)
        return q_out
    check_positions(positions, cos_cache.shape[0])
    cos, sin = cos_cache[positions], sin_cache[positions]
    q_out = rope_torch(q_pe, cos[:, None, :], sin[:, None, :], interleaved)
    k_rot = rope_torch(k_pe, cos, sin, interleaved)
    if kv_cache is not None:
        concat_and_cache_mla(kv_c, k_rot, kv_cache, slot_mapping)
    if k_pe_out is not None:
        k_pe_out.copy_(k_rot)
    return q_out
