"""Runs the MoE routing and alignment kernels (moe_routing.py) on CPU tensors under
TRITON_INTERPRET=1 and compares them with the torch forms (launched by
tests/model_executor/layers/test_moe_routing.py)."""
import os

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from tests.utils.interpret_checks import run_checks  # noqa: E402
from vllm.model_executor.layers import moe_routing  # noqa: E402
from vllm.model_executor.layers.fused_moe import select_experts  # noqa: E402
from vllm.model_executor.layers.moe_kernels import moe_align_block_size  # noqa: E402

# (experts, top_k, groups, kept groups, scoring, bias, renormalize, scale)
ROUTERS = (
    (4, 2, 1, 1, "sigmoid", True, True, 1.5),      # the tiny model's router
    (8, 3, 4, 2, "sigmoid", True, True, 2.5),      # groups of two
    (256, 8, 8, 4, "sigmoid", True, True, 2.5),    # DeepSeek-V3's
    (6, 2, 1, 1, "softmax", False, False, 1.0),    # a softmax router, experts not a power of 2
    (16, 1, 2, 1, "sigmoid", False, True, 1.0),    # top-1 (its weight renormalises to 1)
    (8, 8, 1, 1, "sigmoid", True, True, 1.0),      # every expert chosen
)


def check_routing(gen) -> None:
    for experts, top_k, groups, kept, scoring, bias, renorm, scale in ROUTERS:
        assert moe_routing.route_supported(experts, top_k, groups, kept, scoring)
        for num_tokens in (1, 5, 33):
            logits = torch.randn(num_tokens, experts, generator=gen) * 3
            correction = torch.randn(experts, generator=gen) * 0.2 if bias else None
            kwargs = dict(scoring_func=scoring, correction_bias=correction, num_groups=groups,
                          topk_groups=kept, renormalize=renorm, routed_scaling_factor=scale)
            ref_w, ref_ids = select_experts(logits, top_k, **kwargs)
            got_w, got_ids = moe_routing.route_triton(logits, top_k, **kwargs)
            assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
            assert torch.equal(got_ids, ref_ids), (experts, num_tokens, got_ids, ref_ids)
            torch.testing.assert_close(got_w, ref_w, rtol=1e-6, atol=1e-7)


def check_align(gen) -> None:
    for num_tokens, experts, top_k, block_m in ((1, 256, 8, 16), (5, 4, 2, 16), (7, 4, 2, 16),
                                                (5, 256, 8, 16), (100, 16, 6, 64),
                                                (3, 1, 1, 16), (64, 4, 2, 16)):
        num_pairs = num_tokens * top_k
        assert moe_routing.align_supported(num_pairs, experts, block_m), (num_pairs, experts)
        for skew in (False, True):
            if skew:  # most pairs on few experts: long runs, many empty experts
                ids = torch.randint(0, min(experts, 3), (num_tokens, top_k), generator=gen)
            else:
                ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k]
                                   for _ in range(num_tokens)])
            ref = moe_align_block_size(ids, experts, block_m)
            got = moe_routing.align_triton(ids, experts, block_m)
            assert torch.equal(got[0], ref[0]), (num_tokens, experts, got[0], ref[0])
            assert torch.equal(got[1], ref[1]), (num_tokens, experts, got[1], ref[1])


def main() -> None:
    run_checks(moe_routing.HAS_TRITON, check_routing, check_align)


if __name__ == "__main__":
    main()
