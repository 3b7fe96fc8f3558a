"""Compile every form of the MoE Triton kernels that a step can launch, at start-up.

Why: Triton compiles a kernel on the first launch of each new set of constexprs. The pair
alignment (moe_routing._align_kernel) pads its one program to the next power of two of the
pairs, blocks and slots, and the expert kernels choose their tiles by the pair count
(moe_kernels.moe_block_config), so an eager pass of a token count in a new bucket compiles one
or more kernels in the middle of serving: 0.25-0.43 s each on an H100 (fortieth session,
`scripts/time_context_refill.py`: the first refill of 256 and of 1,024 positions at B=1 took
249 and 430 ms with one kernel compiled, their repeats 6.4 and 6.7 ms). That is what made the
drafter's context refills cost hundreds of plain steps, and a prefill chunk of a new length
pays it too. The counts these kernels read at run time are left unspecialised
(`do_not_specialize`), so one launch per constexpr set compiles everything; this module finds
one token count per set, from 1 to the step's token budget, and runs the layer's routed path
(routing, alignment, both expert kernels) once for each on zeros, before the first request.
The graphs' decode sizes are among them. On a machine whose Triton cache already holds them
(`~/.triton/cache`), each form is a load of a few ms.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch

from vllm.model_executor.layers import moe_kernels
from vllm.model_executor.layers.moe_kernels import moe_block_config
from vllm.model_executor.layers.moe_routing import _align_shape

logger = logging.getLogger(__name__)


def kernel_form(num_tokens: int, num_experts: int, top_k: int, routes_fused: bool,
                aligns_fused: bool = True) -> tuple:
    """What the routed path compiles for a call of `num_tokens` tokens: whether the routing
    kernel runs, the expert kernels' tiles and the alignment's padded sizes (None: the torch
    form, always so where `aligns_fused` is False: VLLM_FUSED_MOE_ROUTING=0). Two counts with
    the same form launch the same compiled kernels."""
    pairs = num_tokens * top_k
    tiles = moe_block_config(pairs)
    align = _align_shape(pairs, num_experts, tiles["BLOCK_M"]) if aligns_fused else None
    return routes_fused, tuple(sorted(tiles.items())), None if align is None else align[:4]


def warmup_token_counts(max_tokens: int, num_experts: int, top_k: int,
                        routes_fused, aligns_fused: bool = True) -> list[int]:
    """The smallest token count of each kernel form over 1..max_tokens. `routes_fused(t)`: whether
    a call of t tokens routes with the kernel (DeepseekMoE.routes_fused)."""
    seen: dict[tuple, int] = {}
    for tokens in range(1, max_tokens + 1):
        form = kernel_form(tokens, num_experts, top_k, routes_fused(tokens), aligns_fused)
        seen.setdefault(form, tokens)
    return sorted(seen.values())


def launch_forms(moe, token_counts: Iterable[int], kernels_on: bool = True) -> None:
    """Run `moe`'s routed path (a DeepseekMoE) on zeros once per count, as its forward does with
    `kernels_on` (its `_kernels_on`: the routing and alignment kernels) on CUDA; no shared
    experts, no TP reduction (no collective: each rank warms alone)."""
    w13 = moe.experts.w13_weight
    for tokens in token_counts:
        x = torch.zeros(tokens, w13.shape[-1], dtype=w13.dtype, device=w13.device)
        weights, ids = moe.route(x, kernels_on)
        moe.experts(x, weights, ids, fused_align=kernels_on)


def _routed_config(moe) -> tuple:
    """MoE layers with equal configs launch the same compiled kernels: warm one of them."""
    w13 = moe.experts.w13_weight
    return (tuple(w13.shape), w13.dtype, w13.device, moe.top_k, moe.num_groups, moe.topk_groups,
            moe.scoring_func, moe.renormalize, moe.gate.e_score_correction_bias is not None)


@torch.inference_mode()
def warm_moe_kernels(models: Iterable[torch.nn.Module | None], max_tokens: int) -> None:
    """Compile the MoE kernel forms of 1..max_tokens tokens for every distinct MoE layer config
    of `models` whose expert kernels run here (CUDA with Triton, not float64; the routing and
    alignment kernels too unless VLLM_FUSED_MOE_ROUTING=0); logs how many forms and how long."""
    from vllm.model_executor.layers.fused_moe import DeepseekMoE
    start, forms, configs = time.perf_counter(), 0, set()
    for model in models:
        if model is None:
            continue
        for moe in model.modules():
            if not isinstance(moe, DeepseekMoE):
                continue
            probe = moe.experts.w13_weight
            if not moe_kernels.experts_use_triton(probe) or _routed_config(moe) in configs:
                continue
            configs.add(_routed_config(moe))
            on = moe._kernels_on(probe)
            counts = warmup_token_counts(
                max_tokens, moe.num_experts, moe.top_k,
                lambda t, moe=moe, on=on: moe.routes_fused_tokens(t, on), aligns_fused=on)
            launch_forms(moe, counts, on)
            forms += len(counts)
    if forms:
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # (the compiles are host work; the launches finish here)
        logger.info("MoE kernels: %d forms for 1-%d tokens compiled or loaded in %.1f s "
                    "(moe_warmup.py)", forms, max_tokens, time.perf_counter() - start)
