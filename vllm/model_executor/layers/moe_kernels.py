"""Routed-expert compute of the DeepSeek MoE without host syncs or a Python loop over experts.

Weights are stacked: w13 [E, 2*I, D] (gate rows then up rows of each expert) and w2 [E, D, I].
For T tokens routed to top_k experts each there are N = T*top_k (token, slot) pairs.

CUDA (Triton), the block-aligned grouped GEMM of upstream vLLM's fused_moe:
  1. `moe_align_block_size` (device-side torch, no sync): the pairs sorted by expert, each expert's
     run padded to a multiple of BLOCK_M with the sentinel N, and the expert id of every BLOCK_M
     block (E for blocks past the last expert's run). The buffer size is a host-known bound:
     N + min(E, N) * (BLOCK_M - 1), rounded up to BLOCK_M (at most min(E, N) experts are non-empty).
  2. `_moe_gate_up_kernel`: per (block, N-tile) inter = silu(x W_gate^T) * (x W_up^T) for the
     block's pairs, float32 accumulation, one store in the activation dtype.
  3. `_moe_down_kernel`: per (block, D-tile) y = routing_weight * inter W2^T, stored at the pair's
     row of a [N, D] buffer (every pair owns one row: no atomics, deterministic); the top_k rows
     of each token are then summed by one `sum`.
Blocks of padding (expert id E) return at once, so the grid can be sized by the bound.

CPU (and CUDA without Triton): `fused_experts_torch` gathers each pair's expert weights and runs
batched mat-vecs in bounded token chunks; exact math, no sync, no loop over experts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# (a module reference, read at call time: moe_routing reads this module the same way)
from vllm.model_executor.layers import moe_routing as _routing
from vllm.triton_utils import HAS_TRITON, tl, triton  # noqa: F401


def padded_pairs_bound(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Host-side upper bound on the padded, expert-sorted pair buffer (a multiple of block_m)."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-bound // block_m) * block_m


# Up to this many (pair, expert) cells the rank of a pair inside its expert comes from a one-hot
# cumsum (decode sizes: plain elementwise kernels, trivially capturable); beyond it, from a sort.
_ONE_HOT_LIMIT = 1 << 22


def moe_align_block_size(ids: torch.Tensor, num_experts: int, block_m: int,
                         use_sort: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] expert ids -> (sorted_pairs [P] int32, block_expert [P // block_m] int32).

    sorted_pairs lists the flat pair indices (token * k + slot) grouped by expert (token order within
    an expert), each expert's run padded to a multiple of block_m with the sentinel N = T*k;
    block_expert[b] is the expert of block b, or num_experts for blocks past the last run.
    Everything stays on the device: no host sync. `use_sort` picks how a pair's rank inside its
    expert is found (None: one-hot cumsum for small N*E, a stable sort otherwise; same result)."""
    flat = ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    device = ids.device
    size = padded_pairs_bound(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount without its host sync
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    if use_sort is None:
        use_sort = num_pairs * num_experts > _ONE_HOT_LIMIT
    if use_sort:
        sorted_experts, order = torch.sort(flat, stable=True)
        count_start = counts.cumsum(0) - counts
        rank = torch.arange(num_pairs, device=device) - count_start[sorted_experts]
        dest, pair_ids = padded_start[sorted_experts] + rank, order
    else:
        one_hot = torch.zeros(num_pairs, num_experts, dtype=torch.int32, device=device)
        one_hot.scatter_(1, flat[:, None], 1)
        rank = one_hot.cumsum(0).gather(1, flat[:, None]).squeeze(1).to(torch.int64) - 1
        dest, pair_ids = padded_start[flat] + rank, torch.arange(num_pairs, device=device)
    sorted_pairs = torch.full((size,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs.scatter_(0, dest, pair_ids)
    block_start = torch.arange(0, size, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    return sorted_pairs.to(torch.int32), block_expert.to(torch.int32)


if HAS_TRITON:

    @triton.jit(do_not_specialize=["num_pairs"])  # (moe_warmup.py: one form per tile set)
    def _moe_gate_up_kernel(x_ptr, x_st, w_ptr, w_se, w_sn, inter_ptr, inter_st, sorted_ptr, block_expert_ptr,
                            num_pairs, num_experts, top_k, inter_size, hidden,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            IEEE: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        if expert >= num_experts:
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + rows)
        row_ok = pair < num_pairs
        token = (pair // top_k).to(tl.int64)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < inter_size
        w_expert = w_ptr + expert * w_se
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < hidden
            a = tl.load(x_ptr + token[:, None] * x_st + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w_mask = k_ok[:, None] & n_ok[None, :]
            w_gate = tl.load(w_expert + n[None, :].to(tl.int64) * w_sn + kk[:, None], mask=w_mask, other=0.0)
            w_up = tl.load(w_expert + (n[None, :] + inter_size).to(tl.int64) * w_sn + kk[:, None], mask=w_mask,
                           other=0.0)
            if IEEE:
                acc_gate += tl.dot(a, w_gate, input_precision="ieee")
                acc_up += tl.dot(a, w_up, input_precision="ieee")
            else:
                acc_gate += tl.dot(a, w_gate)
                acc_up += tl.dot(a, w_up)
        inter = acc_gate * tl.sigmoid(acc_gate) * acc_up  # silu(gate) * up
        tl.store(inter_ptr + rows[:, None].to(tl.int64) * inter_st + n[None, :],
                 inter.to(inter_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])

    @triton.jit(do_not_specialize=["num_pairs"])  # (moe_warmup.py: one form per tile set)
    def _moe_down_kernel(inter_ptr, inter_st, w_ptr, w_se, w_sn, out_ptr, out_st, sorted_ptr, block_expert_ptr,
                         route_w_ptr, num_pairs, num_experts, inter_size, hidden,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         IEEE: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        if expert >= num_experts:
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + rows)
        row_ok = pair < num_pairs
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < hidden
        w_expert = w_ptr + expert * w_se
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter_size, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < inter_size
            a = tl.load(inter_ptr + rows[:, None].to(tl.int64) * inter_st + kk[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_expert + n[None, :].to(tl.int64) * w_sn + kk[:, None],
                        mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(a, w, input_precision="ieee")
            else:
                acc += tl.dot(a, w)
        route_w = tl.load(route_w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * route_w[:, None]
        tl.store(out_ptr + pair[:, None].to(tl.int64) * out_st + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])


def moe_block_config(num_pairs: int) -> dict[str, int]:
    """Tile sizes: small M tiles for decode (few pairs per expert), larger for prefill."""
    block_m = 16 if num_pairs <= 1024 else (32 if num_pairs <= 8192 else 64)
    # decode: few experts are active, so narrow gate_up tiles give more programs to stream weights
    gu_block_n = 16 if num_pairs <= 128 else 32
    return dict(BLOCK_M=block_m, GU_BLOCK_N=gu_block_n, GU_BLOCK_K=128, DOWN_BLOCK_N=64, DOWN_BLOCK_K=64)


def _check_expert_args(x, w13, w2, weights, ids) -> None:
    num_experts, two_inter, hidden = w13.shape
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"fused_experts: x must be [T, {hidden}], got {tuple(x.shape)}")
    if two_inter % 2 or tuple(w2.shape) != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"fused_experts: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit "
                         "[E, 2*I, D] / [E, D, I]")
    if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_experts: ids {tuple(ids.shape)} / weights {tuple(weights.shape)} must both be "
                         f"[T={x.shape[0]}, top_k]")


def fused_experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                         ids: torch.Tensor, config: dict[str, int] | None = None,
                         fused_align: bool = True) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) -> [T, D] in x's dtype, four device-side steps.
    `fused_align`: the alignment in one Triton launch where it fits (moe_routing.align_triton),
    else the torch form."""
    _check_expert_args(x, w13, w2, weights, ids)
    num_tokens, top_k = ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter_size = two_inter // 2
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return x.new_zeros(num_tokens, hidden)
    cfg = dict(moe_block_config(num_pairs), **(config or {}))
    block_m = cfg["BLOCK_M"]
    x = x if x.stride(-1) == 1 else x.contiguous()
    w13 = w13 if w13.stride(-1) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(-1) == 1 else w2.contiguous()
    aligned = _routing.align_triton(ids, num_experts, block_m) if fused_align else None
    if aligned is None:  # (switched off, or more pairs than one program holds)
        aligned = moe_align_block_size(ids, num_experts, block_m)
    sorted_pairs, block_expert = aligned
    num_blocks = block_expert.shape[0]
    ieee = x.dtype == torch.float32  # float32 activations: no TF32 shortcut
    inter = torch.empty(sorted_pairs.shape[0], inter_size, dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(inter_size, cfg["GU_BLOCK_N"]))](
        x, x.stride(0), w13, w13.stride(0), w13.stride(1), inter, inter.stride(0), sorted_pairs, block_expert,
        num_pairs, num_experts, top_k, inter_size, hidden,
        BLOCK_M=block_m, BLOCK_N=cfg["GU_BLOCK_N"], BLOCK_K=cfg["GU_BLOCK_K"], IEEE=ieee, num_warps=4)
    route_w = weights.reshape(-1).to(torch.float32).contiguous()
    pair_out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _moe_down_kernel[(num_blocks, triton.cdiv(hidden, cfg["DOWN_BLOCK_N"]))](
        inter, inter.stride(0), w2, w2.stride(0), w2.stride(1), pair_out, pair_out.stride(0), sorted_pairs,
        block_expert, route_w, num_pairs, num_experts, inter_size, hidden,
        BLOCK_M=block_m, BLOCK_N=cfg["DOWN_BLOCK_N"], BLOCK_K=cfg["DOWN_BLOCK_K"], IEEE=ieee, num_warps=4)
    return pair_out.view(num_tokens, top_k, hidden).sum(dim=1)


# elements of gathered expert weights one chunk may hold (~64 MB in float32)
_GATHER_BUDGET = 1 << 24


# Few experts per routed slot (e.g. the tiny models: 4 experts, top-2): every expert on every token
# as two plain GEMMs beats gathering each token's expert weights (26x on CPU at T=4096, E=4,
# top-2), although it does E/top_k times the routed FLOPs. Real widths (256 experts, top-8) gather.
DENSE_EXPERTS_MAX_RATIO = 4


def fused_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                        ids: torch.Tensor, dense: bool | None = None) -> torch.Tensor:
    """Same contract as `fused_experts_triton`. Nothing reads device values back. `dense` None =
    choose by the expert count (DENSE_EXPERTS_MAX_RATIO); True / False force a path (tests)."""
    _check_expert_args(x, w13, w2, weights, ids)
    num_tokens, top_k = ids.shape
    num_experts = w13.shape[0]
    if dense is None:
        dense = num_experts <= DENSE_EXPERTS_MAX_RATIO * top_k
    if dense:
        return _experts_dense(x, w13, w2, weights, ids)
    return _experts_gathered(x, w13, w2, weights, ids)


def _experts_gathered(x, w13, w2, weights, ids) -> torch.Tensor:
    """Per chunk of tokens, gather the chosen experts' weights and run batched mat-vecs. The loop
    is over token chunks (host-known shapes), never over experts."""
    num_tokens, top_k = ids.shape
    num_experts, two_inter, hidden = w13.shape
    per_token = top_k * (two_inter * hidden + hidden * (two_inter // 2))
    chunk = max(1, _GATHER_BUDGET // max(per_token, 1))
    out = x.new_empty(num_tokens, hidden)
    for start in range(0, num_tokens, chunk):
        sl = slice(start, start + chunk)
        chosen = ids[sl]
        gate_up = torch.einsum("td,tkjd->tkj", x[sl], w13[chosen])
        gate, up = gate_up.chunk(2, dim=-1)
        expert_out = torch.einsum("tki,tkdi->tkd", F.silu(gate) * up, w2[chosen])
        out[sl] = (expert_out * weights[sl].to(x.dtype).unsqueeze(-1)).sum(dim=1)
    return out


def _experts_dense(x, w13, w2, weights, ids) -> torch.Tensor:
    """Every expert on every token (per token chunk), combined with a [T, E] routing matrix that
    holds each token's weights at its chosen experts and zero elsewhere. An unchosen expert's
    output is masked out, not multiplied by zero, so an overflow there cannot turn into NaN."""
    num_tokens, top_k = ids.shape
    num_experts, two_inter, hidden = w13.shape
    per_token = num_experts * (two_inter + hidden)  # activations held per token
    chunk = max(1, _GATHER_BUDGET // max(per_token, 1))
    route = torch.zeros(num_tokens, num_experts, dtype=x.dtype, device=x.device)
    route.scatter_add_(1, ids.long(), weights.to(x.dtype))
    chosen = torch.zeros(num_tokens, num_experts, dtype=torch.bool, device=x.device)
    chosen.scatter_(1, ids.long(), True)
    out = x.new_empty(num_tokens, hidden)
    for start in range(0, num_tokens, chunk):
        sl = slice(start, start + chunk)
        gate_up = torch.einsum("td,ejd->tej", x[sl], w13)
        gate, up = gate_up.chunk(2, dim=-1)
        expert_out = torch.einsum("tei,edi->ted", F.silu(gate) * up, w2)
        weighted = torch.where(chosen[sl].unsqueeze(-1), expert_out * route[sl].unsqueeze(-1), 0.0)
        out[sl] = weighted.sum(dim=1)
    return out


def experts_use_triton(x: torch.Tensor) -> bool:
    """Whether `fused_experts` runs the Triton kernels for activations like x (moe_warmup.py
    compiles their forms where it does)."""
    return HAS_TRITON and x.is_cuda and x.dtype != torch.float64


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, fused_align: bool = True) -> torch.Tensor:
    if experts_use_triton(x):
        return fused_experts_triton(x, w13, w2, weights, ids, fused_align=fused_align)
    return fused_experts_torch(x, w13, w2, weights, ids)
