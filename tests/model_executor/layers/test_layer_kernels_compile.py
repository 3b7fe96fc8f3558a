"""The model layers' Triton kernels compile for sm_90 on a machine without a GPU, in every variant
their launchers produce: RMSNorm (plain and fused with the residual add, DeepSeek's widths, the
activation dtypes), rotary embedding (with and without query heads, interleaved and NeoX) and the
two grouped-GEMM MoE kernels (decode and prefill tiles, bf16 / fp16 and float32 with IEEE dots).
The launchers run on CPU tensors with the kernel swapped for a recorder, so the argument types are
the ones a GPU launch passes; GPU tests check the numbers."""
from __future__ import annotations

import pytest
import torch

from tests.utils.triton_aot import compile_recorded, cuda_target, record_launches

triton = pytest.importorskip("triton")

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def test_rms_norm_kernel_compiles_for_sm90():
    from vllm.model_executor.layers import layernorm as ln
    cuda_target()
    with record_launches(ln, "_rms_norm_kernel") as rec:
        # kv_a (512), q_a (1536) and the hidden width (7168: BLOCK 8192, 16 warps)
        for width in (512, 1536, 7168):
            for dtype in _DTYPES:
                norm = ln.RMSNorm(width).to(dtype)
                x = torch.zeros(4, width, dtype=dtype)
                ln.rms_norm_triton(x, norm.weight, norm.variance_epsilon)
                ln.rms_norm_triton(x, norm.weight, norm.variance_epsilon, residual=torch.zeros_like(x))
        # a float32 weight on bf16 activations (a module left in float32) promotes the output
        ln.rms_norm_triton(torch.zeros(4, 512, dtype=torch.bfloat16), torch.ones(512), 1e-6)
    compile_recorded(rec, expect_at_least=3 * len(_DTYPES) * 2 + 1)


def test_rope_kernel_compiles_for_sm90():
    from vllm.model_executor.layers import rotary_embedding as re
    cuda_target()
    cos = torch.zeros(4096, 32, dtype=torch.float32)
    with record_launches(re, "_rope_kernel") as rec:
        for dtype in _DTYPES:
            for interleaved in (False, True):
                for heads in (16, 128, 0):  # 128 heads: 8 warps; 0: rotate k only
                    q = torch.zeros(8, heads, 64, dtype=dtype)
                    k = torch.zeros(8, 1, 64, dtype=dtype)
                    re.rope_triton(torch.zeros(8, dtype=torch.int64), q, k, cos, cos.clone(), interleaved)
    compile_recorded(rec, expect_at_least=len(_DTYPES) * 2 * 3)


def test_moe_kernels_compile_for_sm90():
    from vllm.model_executor.layers import moe_kernels as mk
    from vllm.model_executor.layers import moe_routing as mr
    cuda_target()
    experts, hidden, inter, top_k = 8, 512, 256, 2
    with record_launches(mk, "_moe_gate_up_kernel") as gate_up, \
            record_launches(mk, "_moe_down_kernel") as down, \
            record_launches(mr, "_align_kernel") as align:
        for dtype in _DTYPES:
            w13 = torch.zeros(experts, 2 * inter, hidden, dtype=dtype)
            w2 = torch.zeros(experts, hidden, inter, dtype=dtype)
            # token counts on each side of moe_block_config's thresholds (pairs 128 / 1024 / 8192)
            for tokens in (4, 256, 2048, 8192):
                ids = torch.zeros(tokens, top_k, dtype=torch.int64)
                ids[:, 1] = 1
                weights = torch.full((tokens, top_k), 0.5, dtype=torch.float32)
                mk.fused_experts_triton(torch.zeros(tokens, hidden, dtype=dtype), w13, w2, weights, ids)
    compile_recorded(gate_up, expect_at_least=len(_DTYPES) * 4)
    compile_recorded(down, expect_at_least=len(_DTYPES) * 3)
    # the one-program alignment where it fits (4 and 256 tokens; 2048 pairs and up keep the
    # torch form)
    compile_recorded(align, expect_at_least=2)


def test_moe_routing_kernel_compiles_for_sm90():
    """moe_routing.route_triton's variants: the tiny model's router (4 experts, top-2), groups
    of two, DeepSeek-V3's (256 experts, 8 groups, 4 kept, top-8), softmax, top-1; one token
    and a verify block's."""
    from vllm.model_executor.layers import moe_routing as mr
    cuda_target()
    routers = ((4, 2, 1, 1, "sigmoid", True), (8, 3, 4, 2, "sigmoid", True),
               (256, 8, 8, 4, "sigmoid", True), (6, 2, 1, 1, "softmax", False),
               (16, 1, 2, 1, "sigmoid", False))
    with record_launches(mr, "_route_kernel") as route:
        for experts, top_k, groups, kept, scoring, bias in routers:
            for tokens in (1, 40):
                mr.route_triton(torch.zeros(tokens, experts), top_k, scoring_func=scoring,
                                correction_bias=torch.zeros(experts) if bias else None,
                                num_groups=groups, topk_groups=kept, renormalize=True,
                                routed_scaling_factor=1.5)
    compile_recorded(route, expect_at_least=len(routers))
