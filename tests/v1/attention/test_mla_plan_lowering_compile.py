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
        for bound in (16, 64, 256):  # builders' bounds (max_num_seqs): BLOCK_R follows them
            plan_lowering.rebuild_csr_triton(
                torch.zeros(8, 64, dtype=torch.int32), lens, 3, 8,
                torch.zeros(9, dtype=torch.int32), torch.zeros(512, dtype=torch.int32),
                ws, 16, torch.zeros(5, dtype=torch.int64), 16, max_requests=bound)
    compile_recorded(lowered, expect_at_least=1)
    compile_recorded(rebuilt, expect_at_least=3)


def test_the_start_up_warm_up_compiles_both_alignments_of_the_graph_kv_len_arr():
    """warm_plan_lowering (called next to the graph captures) launches the lowering kernel with
    kv_len_arr 16-byte aligned and not, the two places a graph wrapper's kv_len_arr can sit in
    its packed buffer (2 * (R + 1) int32 in: aligned for odd R), so no serving step JITs it."""
    from tests.utils.triton_aot import launch_variant
    from vllm.v1.attention.backends.mla import flashinfer_mla, plan_lowering
    cuda_target()
    aligned = {(2 * (r + 1) * 4) % 16 == 0 for r in range(1, 9)}
    assert aligned == {True, False}  # graph sizes of both parities: both variants occur
    for r in (1, 2):  # the packed views themselves
        flat = torch.zeros(flashinfer_mla.packed_csr_size(r, 8), dtype=torch.int32)
        kv_len_arr = flashinfer_mla.packed_csr_views(flat, r)[2]
        assert (kv_len_arr.data_ptr() % 16 == 0) == (r % 2 == 1)
    with record_launches(plan_lowering, "_lower_plan_kernel") as rec:
        plan_lowering._warm_launches(torch.device("cpu"))  # recorded, not run
    variants = {launch_variant(rec.kernel, a, k) for a, k in rec.launches}
    assert len(rec.launches) == 2 and len(variants) == 2
    compile_recorded(rec, expect_at_least=2)


def test_the_page_list_rebuild_is_one_variant_whatever_the_graph_size():
    """Graph wrappers of every size (their CSR arrays at size-dependent offsets inside one
    packed buffer) launch the rebuild as ONE compiled variant for a builder's bound, the one
    warm_page_list_rebuild compiles at start-up."""
    from tests.utils.triton_aot import launch_variant
    from vllm.v1.attention.backends.mla import flashinfer_mla, plan_lowering
    cuda_target()
    with record_launches(plan_lowering, "_rebuild_csr_kernel") as rec:
        plan_lowering._warm_rebuild_launch(torch.device("cpu"), 64)  # recorded, not run
        for planned in (1, 2, 3, 8, 24, 64):
            flat = torch.zeros(flashinfer_mla.packed_csr_size(planned, 128), dtype=torch.int32)
            _, kv_indptr, _, kv_indices = flashinfer_mla.packed_csr_views(flat, planned)
            plan_lowering.rebuild_csr_triton(
                torch.zeros(planned, 8, dtype=torch.int32), torch.ones(planned, dtype=torch.int32),
                planned, planned, kv_indptr, kv_indices, torch.zeros(4096, dtype=torch.int32),
                16, torch.zeros(planned, dtype=torch.int64), 16, max_requests=64)
    variants = {launch_variant(rec.kernel, a, k) for a, k in rec.launches}
    assert len(rec.launches) == 7 and len(variants) == 1
    compile_recorded(rec, expect_at_least=1)
