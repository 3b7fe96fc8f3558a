"""The decode step's Triton kernels compile for sm_90 on a machine without a GPU: the fused
step preparation (with and without DCP), the slot mappings and the DCP-local lengths, with the
argument types their launchers pass (recorded from real launcher calls on CPU tensors). A GPU
run then only has to show that they compute the right thing (test_prepare_step_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from tests.utils.prepare_step_cases import random_prep_case
from tests.utils.triton_aot import compile_launch, cuda_target, record_launches

triton = pytest.importorskip("triton")


def test_fused_prepare_step_kernel_compiles_for_sm90():
    import vllm.v1.worker.gpu.prepare_step as ps
    cuda_target()
    with record_launches(ps, "_prepare_step_kernel") as rec:
        for seed in range(12):
            buffers, args = random_prep_case(seed, "cpu")
            args.pop("num_logits")
            ps.prepare_step_triton(buffers, **args)
    variants = {}
    for args, kwargs in rec.launches:
        variants.setdefault(kwargs["HAS_DCP"], (args, kwargs))
    assert set(variants) == {False, True}  # the random cases cover DCP 1 and DCP > 1
    for args, kwargs in variants.values():
        compiled = compile_launch(rec.kernel, args, kwargs)
        assert compiled.asm["cubin"]


def test_slot_mapping_and_dcp_length_kernels_compile_for_sm90():
    from vllm.v1.worker.gpu import block_table, cp_utils
    cuda_target()
    i32, i64 = torch.int32, torch.int64
    groups, rows, cols, tokens = 2, 8, 16, 40
    slot_args = (torch.zeros(groups, 64, dtype=i64), 64,
                 torch.zeros(groups, rows, cols, dtype=i32), rows * cols, cols,
                 torch.zeros(groups, dtype=i32), torch.ones(groups, dtype=i32),
                 torch.full((groups,), cols, dtype=i32), torch.zeros(rows + 1, dtype=i32),
                 torch.zeros(tokens, dtype=i64), rows, tokens, 0, 1)
    assert compile_launch(block_table._compute_slot_mappings_kernel, slot_args,
                          {"BLOCK": 256}).asm["cubin"]
    dcp_args = (torch.zeros(rows, dtype=i32), torch.zeros(rows, dtype=i32), 5, rows, 2, 1, 4)
    assert compile_launch(cp_utils._dcp_local_seq_lens_kernel, dcp_args,
                          {"BLOCK": 128}).asm["cubin"]
