"""The DeepSeek MoE's routing and pair alignment in one Triton kernel each, for decode-sized
batches on CUDA.

Why: the torch forms (fused_moe.select_experts, moe_kernels.moe_align_block_size) are ~25 small
kernels per MoE layer (sigmoid, bias add, group top-k, top-k, gather, sum, divide, scale; then
bincount, padding, cumsums, one-hot ranks, sentinel fill, scatter, searchsorted, casts). In a
CUDA graph each is a node of ~1.5 us however little it computes, so on the tiny model they are
~50 of the ~176 kernels of a DSpark verify step (`scripts/graph_kernels.py`, thirty-third
session), and a synchronous speculative step waits for that GPU time where the host is fast.
Here each is one launch.

Same results as the torch forms: the same experts and pair order (ties aside: a top-k among
exactly equal scores may pick another of them; the torch form's choice among ties is not
specified either), weights to float32 rounding (the kernel's exp and sum are its own). Where a
config does not fit (group sizes that are not powers of two, batches too large for one
program's registers), the callers keep the torch forms (`route_supported`,
`align_supported`). `VLLM_FUSED_MOE_ROUTING=0` keeps them everywhere (read when a MoE layer is
built).
"""
from __future__ import annotations

import torch

# (a module reference, read at call time: moe_kernels imports this module's names)
from vllm.model_executor.layers import moe_kernels as _kernels
from vllm.triton_utils import HAS_TRITON, next_pow2, tl, triton  # noqa: F401
from vllm.utils.env_flags import switch_flag

ENV_FLAG = "VLLM_FUSED_MOE_ROUTING"
# The kernels serve decode-sized calls only; a prefill keeps the torch forms, so its memory
# profile and temporaries are what they were. Routing: up to this many tokens.
MAX_ROUTE_TOKENS = 1024
# Alignment: one program holds a [pairs, expert chunk] one-hot and a [blocks, expert chunk]
# range test of at most _MAX_CELLS cells, over at most _MAX_CHUNKS chunks. Why so small: with
# 16K cells (the first version; thirty-third session, one H100, run SH) one call at 256 pairs
# over 256 experts (V3 rank, B=32 decode) took 0.3 ms, about twice what that layer's torch
# routing and alignment took together; at 8 pairs (B=1) the kernels cut the step's GPU time.
_MAX_CELLS = 1 << 12
_MAX_CHUNKS = 4
_MAX_SLOTS = 1 << 16
_EXPERT_CHUNK = 64


def fused_routing_enabled() -> bool:
    return switch_flag(ENV_FLAG, True, "route and align MoE pairs with one Triton kernel each "
                       "on CUDA", "use the torch forms (about 25 small kernels a layer)")


def route_supported(num_experts: int, top_k: int, num_groups: int, topk_groups: int,
                    scoring_func: str) -> bool:
    """Whether route_triton serves this router: groups a power of two and, with several
    groups, a power-of-two group size (the kernel views the experts as [groups, size]). The
    caller also keeps calls of more than MAX_ROUTE_TOKENS tokens on the torch form."""
    if scoring_func not in ("sigmoid", "softmax") or not 1 <= top_k <= num_experts <= 1024:
        return False
    if num_groups <= 1:
        return True
    size = num_experts // num_groups
    return (num_experts % num_groups == 0 and next_pow2(num_groups) == num_groups
            and next_pow2(size) == size and 1 <= topk_groups <= num_groups)


def _align_shape(num_pairs: int, num_experts: int, block_m: int) -> tuple | None:
    """(P_PAD, E_CHUNK, NB_PAD, S_PAD, slots, blocks) of align_triton's one program, or None
    where it does not fit: the expert chunk shrinks as the pairs grow, so that a [pairs,
    chunk] one-hot and a [blocks, chunk] range test stay within _MAX_CELLS."""
    if num_pairs <= 0 or num_experts <= 0:
        return None
    slots = _kernels.padded_pairs_bound(num_pairs, num_experts, block_m)
    blocks = slots // block_m
    pairs_pad, blocks_pad = max(next_pow2(num_pairs), 16), max(next_pow2(blocks), 16)
    chunk = min(max(next_pow2(num_experts), 2), _EXPERT_CHUNK,
                _MAX_CELLS // max(pairs_pad, blocks_pad))
    if chunk < 2 or -(-num_experts // chunk) > _MAX_CHUNKS or next_pow2(slots) > _MAX_SLOTS:
        return None
    return pairs_pad, chunk, blocks_pad, max(next_pow2(slots), 16), slots, blocks


def align_supported(num_pairs: int, num_experts: int, block_m: int) -> bool:
    """Whether align_triton fits one program for this many pairs."""
    return _align_shape(num_pairs, num_experts, block_m) is not None


if HAS_TRITON:

    @triton.jit
    def _route_kernel(logits_ptr, logits_stride, bias_ptr, weights_ptr, ids_ptr, num_experts,
                      scale, GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr,
                      TOPK_GROUPS: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                      SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
                      RENORMALIZE: tl.constexpr):
        # one token per program: scores, (group-limited) top-k by repeated arg-max (the lowest
        # expert id among equal maxima), the chosen experts' unbiased scores as weights
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, GROUPS * GROUP_SIZE)
        ok = e < num_experts
        x = tl.load(logits_ptr + t * logits_stride + e, mask=ok,
                    other=float("-inf")).to(tl.float32)
        if SOFTMAX:
            p = tl.exp(x - tl.max(x, axis=0))
            scores = p / tl.sum(p, axis=0)
        else:
            scores = tl.sigmoid(x)
        choice = scores
        if HAS_BIAS:
            choice = choice + tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32)
        choice = tl.where(ok, choice, float("-inf"))
        if GROUPS > 1:
            # a group scores the sum of its two best experts (its best alone if it holds one);
            # the TOPK_GROUPS best groups stay, every other expert is out
            grid = tl.reshape(choice, (GROUPS, GROUP_SIZE))
            i = tl.arange(0, GROUP_SIZE)
            top1 = tl.max(grid, axis=1)
            if GROUP_SIZE > 1:
                first = tl.min(tl.where(grid == top1[:, None], i[None, :], GROUP_SIZE), axis=1)
                rest = tl.where(i[None, :] == first[:, None], float("-inf"), grid)
                group_score = top1 + tl.max(rest, axis=1)
            else:
                group_score = top1
            g = tl.arange(0, GROUPS)
            keep = tl.zeros((GROUPS,), dtype=tl.int32)
            for _ in tl.static_range(TOPK_GROUPS):
                best = tl.max(group_score, axis=0)
                pick = tl.min(tl.where(group_score == best, g, GROUPS), axis=0)
                keep = tl.where(g == pick, 1, keep)
                group_score = tl.where(g == pick, float("-inf"), group_score)
            grid = tl.where(keep[:, None] == 1, grid, float("-inf"))
            choice = tl.reshape(grid, (GROUPS * GROUP_SIZE,))
        k = tl.arange(0, K_PAD)
        weights = tl.zeros((K_PAD,), dtype=tl.float32)
        ids = tl.zeros((K_PAD,), dtype=tl.int64)
        for j in tl.static_range(TOP_K):
            best = tl.max(choice, axis=0)
            pick = tl.min(tl.where(choice == best, e, GROUPS * GROUP_SIZE), axis=0)
            pick = tl.minimum(pick, num_experts - 1)  # (a NaN row: any valid id, not past E)
            weight = tl.sum(tl.where(e == pick, scores, 0.0), axis=0)
            weights = tl.where(k == j, weight, weights)
            ids = tl.where(k == j, pick.to(tl.int64), ids)
            choice = tl.where(e == pick, float("-inf"), choice)
        if RENORMALIZE:
            weights = weights / (tl.sum(weights, axis=0) + 1e-20)
        weights = weights * scale
        tl.store(weights_ptr + t * TOP_K + k, weights, mask=k < TOP_K)
        tl.store(ids_ptr + t * TOP_K + k, ids, mask=k < TOP_K)

    # (the pair, slot and block counts vary with every batch: left unspecialised, one compiled
    # form per constexpr set, which moe_warmup.py compiles at start-up)
    @triton.jit(do_not_specialize=["num_pairs", "size", "num_blocks"])
    def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_experts, size,
                      num_blocks, BLOCK_M: tl.constexpr, P_PAD: tl.constexpr,
                      E_CHUNK: tl.constexpr, NB_PAD: tl.constexpr, S_PAD: tl.constexpr):
        # moe_align_block_size in one program: per chunk of experts, a one-hot of the pairs
        # gives each expert's count (its run padded to BLOCK_M), each pair's rank inside its
        # expert (token order) and so its slot, and which blocks the experts' runs cover
        p = tl.arange(0, P_PAD)
        p_ok = p < num_pairs
        expert = tl.load(ids_ptr + p, mask=p_ok, other=-1).to(tl.int32)
        b = tl.arange(0, NB_PAD)
        block_start = b * BLOCK_M
        block_expert = tl.zeros((NB_PAD,), dtype=tl.int32) + num_experts
        dest = tl.zeros((P_PAD,), dtype=tl.int32)
        start = tl.sum(tl.zeros((E_CHUNK,), dtype=tl.int32), axis=0)  # the next run's slot
        c = tl.arange(0, E_CHUNK)
        for e0 in range(0, num_experts, E_CHUNK):
            eid = e0 + c
            hot = (expert[:, None] == eid[None, :]).to(tl.int32)
            counts = tl.sum(hot, axis=0)
            padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
            run_end = start + tl.cumsum(padded, axis=0)
            run_start = run_end - padded
            rank = tl.cumsum(hot, axis=0) - 1
            dest += tl.sum(tl.where(hot == 1, run_start[None, :] + rank, 0), axis=1)
            hit = ((block_start[:, None] >= run_start[None, :])
                   & (block_start[:, None] < run_end[None, :]))
            covered = tl.sum(hit.to(tl.int32), axis=1) > 0
            block_expert = tl.where(covered, tl.sum(tl.where(hit, eid[None, :], 0), axis=1),
                                    block_expert)
            start += tl.sum(padded, axis=0)
        tl.store(block_expert_ptr + b, block_expert, mask=b < num_blocks)
        s = tl.arange(0, S_PAD)
        tl.store(sorted_ptr + s, tl.zeros((S_PAD,), dtype=tl.int32) + num_pairs, mask=s < size)
        tl.debug_barrier()  # every sentinel is written before a pair overwrites its slot
        tl.store(sorted_ptr + dest, p, mask=p_ok)


def route_triton(router_logits: torch.Tensor, top_k: int, *, scoring_func: str,
                 correction_bias: torch.Tensor | None, num_groups: int, topk_groups: int,
                 renormalize: bool,
                 routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_moe.select_experts in one launch: (weights [T, k] float32, expert ids [T, k] int64).
    The caller has checked route_supported."""
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    num_tokens, num_experts = logits.shape
    groups = max(int(num_groups), 1)
    size = num_experts // groups if groups > 1 else next_pow2(num_experts)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    bias = correction_bias if correction_bias is not None else logits
    _route_kernel[(num_tokens,)](
        logits, logits.stride(0), bias, weights, ids, num_experts, float(routed_scaling_factor),
        GROUPS=groups, GROUP_SIZE=size, TOPK_GROUPS=int(topk_groups) if groups > 1 else 1,
        TOP_K=top_k, K_PAD=max(next_pow2(top_k), 2), SOFTMAX=scoring_func == "softmax",
        HAS_BIAS=correction_bias is not None, RENORMALIZE=bool(renormalize),
        num_warps=1 if groups * size <= 64 else 4)
    return weights, ids


def align_triton(ids: torch.Tensor, num_experts: int,
                 block_m: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """moe_kernels.moe_align_block_size in one launch (same outputs, int32), or None where
    one program does not fit these pairs (align_supported): the caller keeps the torch form."""
    flat = ids.reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    num_pairs = flat.numel()
    shape = _align_shape(num_pairs, num_experts, block_m)
    if shape is None:
        return None
    pairs_pad, chunk, blocks_pad, slots_pad, slots, blocks = shape
    sorted_pairs = torch.empty(slots, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=flat.device)
    _align_kernel[(1,)](
        flat, sorted_pairs, block_expert, num_pairs, num_experts, slots, blocks,
        BLOCK_M=block_m, P_PAD=pairs_pad, E_CHUNK=chunk, NB_PAD=blocks_pad, S_PAD=slots_pad,
        num_warps=4)
    return sorted_pairs, block_expert
