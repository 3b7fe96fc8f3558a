"""The sampling step's Triton kernels compile for sm_90 on a machine without a GPU: the greedy
verification of eager steps (vllm/v1/sample/ops/greedy_verify.py) for k = 1..6 drafts, with the
argument types its launcher passes (recorded from real launcher calls on CPU tensors: int32
cu_num_logits of the staging buffer, int64 slots, rows, drafts, last_sampled and output)."""
from __future__ import annotations

import pytest

from tests.utils.greedy_verify_cases import random_greedy_verify_case
from tests.utils.triton_aot import compile_recorded, cuda_target, record_launches

pytest.importorskip("triton")


def test_greedy_verify_kernel_compiles_for_sm90():
    from vllm.v1.sample.ops import greedy_verify as gv
    cuda_target()
    ks = set()
    with record_launches(gv, "_greedy_verify_kernel") as rec:
        for seed in range(30):
            case = random_greedy_verify_case(seed)
            ks.add(case["draft_tokens"].shape[1])
            gv.greedy_verify_triton(case["logits"].argmax(-1), case["cu"], case["slots"],
                                    case["rows"], case["draft_tokens"], case["last_sampled"],
                                    case["out"], len(case["rows_np"]))
    assert ks == set(range(1, 7))
    # one variant per k (K and BLOCK are constexprs), as a GPU compiles each of them
    compile_recorded(rec, expect_at_least=6)
