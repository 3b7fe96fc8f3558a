"""The decode step's Triton kernels compile for sm_90 on a machine without a GPU: the fused
step preparation (with and without DCP), the slot mappings and the DCP-local lengths (without DCP
and on several DCP ranks), with the argument types their launchers pass (recorded from real
launcher calls on CPU tensors). A GPU run then only has to show that they compute the right thing (test_prepare_step_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from tests.utils.prepare_step_cases import random_prep_case
from tests.utils.triton_aot import (
    compile_launch,
    compile_recorded,
    cuda_target,
    record_launches,
)

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


def test_fused_prepare_step_kernel_compiles_for_sm90():
    import vllm.v1.worker.gpu.prepare_step as ps
    cuda_target()
    with record_launches(ps, "_prepare_step_kernel") as rec:
        for seed in range(12):
            buffers, args = random_prep_case(seed, "cpu")
            args.pop("num_logits")
            ps.prepare_step_triton(buffers, **args)
    assert {kwargs["HAS_DCP"] for _, kwargs in rec.launches} == {False, True}  # DCP 1 and > 1
    # every distinct specialization the cases launch (e.g. one KV group or one draft column turn
    # into constants), as a GPU would compile each of them
    compile_recorded(rec, expect_at_least=2)


def test_slot_mapping_kernel_compiles_for_sm90():
    from vllm.v1.worker.gpu import block_table as bt
    cuda_target()
    qsl = torch.tensor([0, 3, 4, 9], dtype=torch.int32)  # the staging buffer's int32
    positions = torch.zeros(40, dtype=torch.int64)
    with record_launches(bt, "_compute_slot_mappings_kernel") as rec:
        # no DCP; DCP ranks 0, 1 (a specialised constant) and 3 with interleave 1 and 16
        for cp_size, cp_rank, interleave in ((1, 0, 1), (2, 1, 1), (4, 0, 16), (4, 3, 16)):
            tables = bt.BlockTables([64, 64], 8, 16, 64, "cpu", cp_size=cp_size, cp_rank=cp_rank,
                                    cp_interleave=interleave)
            tables._compute_slot_mappings_triton(qsl, positions, 3, 40)
    compile_recorded(rec, expect_at_least=4)


def test_dcp_local_length_kernel_compiles_for_sm90():
    from vllm.v1.worker.gpu import cp_utils
    cuda_target()
    with record_launches(cp_utils, "_dcp_local_seq_lens_kernel") as rec:
        for cp_size, cp_rank, interleave in ((2, 0, 1), (2, 1, 1), (4, 3, 16), (8, 0, 16)):
            out = torch.zeros(64, dtype=torch.int32)  # the input batch's int32 buffers
            cp_utils._prepare_triton(out, torch.zeros(64, dtype=torch.int32), 5, cp_size, cp_rank,
                                     interleave)
    compile_recorded(rec, expect_at_least=4)


# The check itself fails on what a GPU launch rejects (so the tests above can fail).
@triton.jit
def _carried_type_change(out_ptr, n):
    acc = 0
    for i in range(n):
        acc += tl.load(out_ptr + i).to(tl.int64)  # int32 loop carry re-assigned as int64
    tl.store(out_ptr, acc)


@triton.jit
def _oversized_pipeline(a_ptr, out_ptr, K, B: tl.constexpr):
    r = tl.arange(0, B)
    acc = tl.zeros((B, B), dtype=tl.float32)
    for k in range(0, K, B):
        a = tl.load(a_ptr + r[:, None] * K + k + r[None, :])
        b = tl.load(a_ptr + (k + r[:, None]) * K + r[None, :])
        acc += tl.dot(a, b)
    tl.store(out_ptr + r[:, None] * B + r[None, :], acc)


def test_compile_launch_rejects_type_errors_and_oversized_shared_memory():
    cuda_target()
    with pytest.raises(triton.compiler.CompilationError, match="Loop-carried variable acc"):
        compile_launch(_carried_type_change, (torch.zeros(8, dtype=torch.int32), 8), {})
    args = (torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.float32), 4096)
    with pytest.raises(AssertionError, match="bytes of shared memory"):
        compile_launch(_oversized_pipeline, args, {"B": 256, "num_stages": 4, "num_warps": 8})
