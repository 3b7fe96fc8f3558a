"""Cross-rank pieces of MLA decode under DCP (DESIGN §4).

Each DCP rank attends the all-gathered query heads against its own KV shard and
gets a partial (O_n, lse_n). The exact result is
    lse_g = logsumexp_n lse_n,     O = sum_n exp(lse_n - lse_g) * O_n.
`cp_lse_ag_out_rs` all-gathers the LSEs, rescales the local O (correct_attn_out)
and reduce-scatters the sum back to each rank's own heads.

NaN-safety: a NaN or +inf LSE counts as -inf (no contribution); a row that is
empty on every rank ends as O = 0, LSE = -inf, and a zero weight never touches
O (so 0 * NaN cannot leak). The LSE base is an explicit flag: base-2 LSEs
(FlashInfer's default) fed as natural logs would silently mis-weight ranks.
"""
from __future__ import annotations

import math

import torch

from vllm.triton_utils import HAS_TRITON, tl, triton  # noqa: F401

LN2 = math.log(2.0)


def _clean_lse(lse: torch.Tensor) -> torch.Tensor:
    bad = torch.isnan(lse) | (lse == float("inf"))
    return torch.where(bad, torch.full_like(lse, float("-inf")), lse)


def _lse_weights(lses: torch.Tensor, lse_base_on_e: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """lses [N, ...] -> (weights [N, ...] summing to 1 or all 0, global lse [...] in input base)."""
    compute = torch.float64 if lses.dtype == torch.float64 else torch.float32
    lses = _clean_lse(lses.to(compute))
    natural = lses if lse_base_on_e else lses * LN2
    peak = natural.max(dim=0).values
    alive = torch.isfinite(peak)
    safe_peak = torch.where(alive, peak, torch.zeros_like(peak))
    total = torch.exp(natural - safe_peak).sum(dim=0)
    lse_g = torch.where(alive, torch.log(total) + safe_peak, torch.full_like(peak, float("-inf")))
    weights = torch.where(alive.unsqueeze(0) & torch.isfinite(natural),
                          torch.exp(natural - lse_g.unsqueeze(0)), torch.zeros_like(natural))
    return weights, (lse_g if lse_base_on_e else lse_g / LN2)


def merge_attn_states(outs: torch.Tensor, lses: torch.Tensor,
                      lse_base_on_e: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge N partial states at once: outs [N, T, H, D], lses [N, T, H] -> (out, lse).

    Used to simulate DCP in one process (tests, benchmarks); same maths as the
    distributed path.
    """
    weights, lse_g = _lse_weights(lses, lse_base_on_e)
    compute = weights.dtype
    contrib = torch.where(weights.unsqueeze(-1) > 0, outs.to(compute) * weights.unsqueeze(-1),
                          torch.zeros((), dtype=compute, device=outs.device))
    return contrib.sum(dim=0).to(outs.dtype), lse_g


def correct_attn_out_torch(out: torch.Tensor, lses: torch.Tensor, cp_rank: int,
                           lse_base_on_e: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    weights, lse_g = _lse_weights(lses, lse_base_on_e)
    w = weights[cp_rank].unsqueeze(-1)
    scaled = torch.where(w > 0, out.to(w.dtype) * w, torch.zeros((), dtype=w.dtype,
                                                                  device=out.device))
    return scaled.to(out.dtype), lse_g


if HAS_TRITON:

    @triton.jit
    def _correct_attn_out_kernel(out_ptr, lses_ptr, new_out_ptr, new_lse_ptr,
                                 num_ranks, cp_rank, num_heads, head_dim,
                                 o_stride_t, o_stride_h, l_stride_n, l_stride_t, l_stride_h,
                                 no_stride_t, no_stride_h, nl_stride_t, nl_stride_h,
                                 IS_BASE_E: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        # One program per (token, block of BLOCK_H heads): a [BLOCK_N, BLOCK_H] tile of LSEs
        # gives BLOCK_H scale factors, then one [BLOCK_H, BLOCK_D] tile of O is rescaled.
        # Many heads per program keeps the grid small and the O loads wide (memory bound).
        t = tl.program_id(0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = h < num_heads
        n = tl.arange(0, BLOCK_N)
        lmask = (n[:, None] < num_ranks) & hmask[None, :]
        lse = tl.load(lses_ptr + n[:, None] * l_stride_n + t * l_stride_t + h[None, :] * l_stride_h,
                      mask=lmask, other=float("-inf")).to(tl.float32)
        lse = tl.where((lse != lse) | (lse == float("inf")), float("-inf"), lse)
        if not IS_BASE_E:
            lse = lse * 0.6931471805599453
        peak = tl.max(lse, axis=0)
        alive = peak > float("-inf")
        safe_peak = tl.where(alive, peak, 0.0)
        total = tl.sum(tl.exp(lse - safe_peak[None, :]), axis=0)
        lse_g = tl.where(alive, tl.log(total) + safe_peak, float("-inf"))
        own = tl.sum(tl.where(n[:, None] == cp_rank, lse, 0.0), axis=0)
        factor = tl.where(alive & (own > float("-inf")), tl.exp(own - lse_g), 0.0)
        d = tl.arange(0, BLOCK_D)
        omask = hmask[:, None] & (d[None, :] < head_dim)
        o = tl.load(out_ptr + t * o_stride_t + h[:, None] * o_stride_h + d[None, :], mask=omask,
                    other=0.0).to(tl.float32)
        # where(), not a multiply: an empty row's O may hold NaN, and 0 * NaN must not leak.
        o = tl.where(factor[:, None] > 0.0, o * factor[:, None], 0.0)
        tl.store(new_out_ptr + t * no_stride_t + h[:, None] * no_stride_h + d[None, :],
                 o.to(new_out_ptr.dtype.element_ty), mask=omask)
        if not IS_BASE_E:
            lse_g = lse_g * 1.4426950408889634
        tl.store(new_lse_ptr + t * nl_stride_t + h * nl_stride_h, lse_g, mask=hmask)


# Swept on an H200 (B=64, 128 heads, N in {2,4,8}; heads/program 1-16 x warps 1-8): 4 heads and
# 4 warps were within noise of the best everywhere, ~4.2 us per merge amortised in a graph.
_MERGE_HEADS_PER_PROGRAM = 4


def correct_attn_out_triton(out: torch.Tensor, lses: torch.Tensor, cp_rank: int,
                            lse_base_on_e: bool = True, heads_per_program: int | None = None,
                            num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    out = out.contiguous()
    num_ranks, num_tokens, num_heads = lses.shape
    new_out = torch.empty_like(out)
    new_lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=out.device)
    if num_tokens == 0:
        return new_out, new_lse
    block_h = min(heads_per_program or _MERGE_HEADS_PER_PROGRAM, triton.next_power_of_2(num_heads))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _correct_attn_out_kernel[grid](
        out, lses, new_out, new_lse, num_ranks, cp_rank, num_heads, out.shape[-1],
        out.stride(0), out.stride(1), lses.stride(0), lses.stride(1), lses.stride(2),
        new_out.stride(0), new_out.stride(1), new_lse.stride(0), new_lse.stride(1),
        IS_BASE_E=lse_base_on_e, BLOCK_N=triton.next_power_of_2(max(num_ranks, 2)),
        BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(out.shape[-1]), num_warps=num_warps)
    return new_out, new_lse


def correct_attn_out(out: torch.Tensor, lses: torch.Tensor, cp_rank: int,
                     lse_base_on_e: bool = True, use_triton: bool | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rescale this rank's partial output by its share of the global softmax mass.

    out [T, H, D] (this rank's partial O), lses [N, T, H] (every rank's LSE, rank order)
    -> (exp(lse_rank - lse_g) * out, lse_g [T, H]) with lse_g in the input base.
    Triton fused kernel on CUDA (float32 LSE math), torch elsewhere or for float64.
    """
    if lses.dim() != 3 or lses.shape[1:] != out.shape[:2]:
        raise ValueError(f"correct_attn_out: lses must be [N, T, H] matching out [T, H, D]; got "
                         f"lses {tuple(lses.shape)}, out {tuple(out.shape)}.")
    if not 0 <= cp_rank < lses.shape[0]:
        raise ValueError(f"correct_attn_out: cp_rank={cp_rank} outside [0, {lses.shape[0]}).")
    if use_triton is None:
        use_triton = (HAS_TRITON and out.is_cuda and out.dtype != torch.float64
                      and lses.dtype != torch.float64)
    if use_triton:
        return correct_attn_out_triton(out, lses, cp_rank, lse_base_on_e)
    return correct_attn_out_torch(out, lses, cp_rank, lse_base_on_e)


def dcp_all_gather_q(q: torch.Tensor, dcp_group) -> torch.Tensor:
    """[T, H_local, 576] -> [T, N*H_local, 576]: concat of the ranks' head shards (token-major)."""
    return dcp_group.all_gather(q.contiguous(), dim=1)


def cp_lse_ag_out_rs(out: torch.Tensor, lse: torch.Tensor, dcp_group,
                     lse_base_on_e: bool = True, return_lse: bool = False):
    """Merge partial decode outputs over the DCP group and return this rank's heads.

    out [T, H_g, 512], lse [T, H_g] (this rank's partials over all gathered heads)
    -> out [T, H_g/N, 512] (and the merged lse [T, H_g/N] when return_lse).
    """
    n = dcp_group.world_size
    if n == 1:
        return (out, lse) if return_lse else out
    if out.shape[1] % n != 0:
        raise ValueError(f"cp_lse_ag_out_rs: {out.shape[1]} gathered heads do not split over "
                         f"{n} DCP ranks.")
    lses = dcp_group.all_gather(lse.unsqueeze(0).contiguous(), dim=0)  # [N, T, H_g]
    corrected, lse_g = correct_attn_out(out, lses, dcp_group.rank_in_group, lse_base_on_e)
    local = dcp_group.reduce_scatter(corrected, dim=1)
    if not return_lse:
        return local
    heads = out.shape[1] // n
    r = dcp_group.rank_in_group
    return local, lse_g[:, r * heads:(r + 1) * heads]
