"""The plan lowering's Triton kernels (plan_lowering.py: the lengths, and the page lists rebuilt
from the device block table) compile for sm_90 on a machine without a GPU, with the argument
types their launchers pass (recorded from launcher calls on CPU tensors, as the runner makes
them: int32 lengths and tables, the int32 workspace, int64 index and work maps)."""
from __future__ import annotations

import pytest
import torch

from tests.utils.triton_aot import compile_recorded, cuda_target, record_launches

triton = pytest.importorskip("triton")


def test_the_lowering_kernels_compile_for_sm90():
    from vllm.v1.attention.backends.mla import plan_lowering
    cuda_target()
    ws = torch.zeros(4096, dtype=torch.int32)
    lens = torch.tensor([70, 700, 9], dtype=torch.int32)
    with record_launches(plan_lowering, "_lower_plan_kernel") as lowered:
        plan_lowering.lower_plan_triton(ws, torch.arange(12, dtype=torch.int64), lens,
                                        torch.zeros(8, dtype=torch.int32), 3, 3, 3)
    with record_launches(plan_lowering, "_rebuild_csr_kernel") as rebuilt:
        for planned in (3, 8, 40):  # graph sizes: BLOCK_R follows the planned request count
            plan_lowering.rebuild_csr_triton(
                torch.zeros(planned, 64, dtype=torch.int32), lens, 3, planned,
                torch.zeros(planned + 1, dtype=torch.int32), torch.zeros(512, dtype=torch.int32),
                ws, 16, torch.zeros(5, dtype=torch.int64), 16)
    compile_recorded(lowered, expect_at_least=1)
    compile_recorded(rebuilt, expect_at_least=3)
