"""A FlashInfer MLA graph wrapper's plan held from one step, on the CPU (the plan-model
stand-in of fake_flashinfer.py: real plan layouts, FlashInfer's planner modelled), for the
tests of advances, device lowerings and the plan cache (tests/v1/attention)."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import torch

from tests.utils.fake_flashinfer import PlanModelWrapper, install_native_replan
from tests.utils.flashinfer_mla_plan_model import (assert_valid_plan, limit_of, model_plan,
                                                   plan_works)
from tests.utils.mla_dcp_helpers import build_rank, make_case, mla_spec, parallel_config
from vllm.v1.attention.backends.mla.flashinfer_mla import PAGE_LIST_REBUILD_FLAG
from vllm.v1.attention.backends.mla.flashinfer_plan_refresh import refresh_slack

HEADS = 16
NUM_SM = 132  # the plan model's (fake_flashinfer.plan_model_native)
Q = 5  # a DSpark block of k = 4 drafts and its anchor (non-causal), or a verify block
PAGE = 16
# The plan is made for UPPER (a step's upper bound); the device lengths are EXACT (past UPPER
# for every request, in the pages listed for UPPER: 45, 129, 5, 1 pages of 16, and in every
# request's chunk count).
UPPER = [708, 2053, 70, 12]
EXACT = [712, 2056, 74, 14]


def held_plan(monkeypatch, causal: bool, rebuild: bool = True,
              wrapper_cls: type = PlanModelWrapper, max_model_len: int = 4096,
              exact=EXACT, upper=UPPER):
    """A graph plan held for draft blocks (non-causal) or verify rows (causal), on a
    builder with the page-list rebuild (VLLM_PLAN_PAGE_LIST_REBUILD) on unless `rebuild` is
    False: planned for lengths `upper`, the device lengths at `exact` (whose pages the block
    table rows hold). Returns (builder, metadata, the int workspace as int32, a host refresh
    of that workspace for lengths -> its bytes, the metadata input that planned it)."""
    install_native_replan(monkeypatch, wrapper_cls)
    monkeypatch.setenv(PAGE_LIST_REBUILD_FLAG, "1" if rebuild else "0")
    from vllm.v1.attention.backends.mla import flashinfer_mla as fm
    from vllm.v1.attention.backends.mla.flashinfer_plan_refresh import PlanRefresher
    config = SimpleNamespace(parallel_config=parallel_config(1, 1).parallel_config,
                             model_config=SimpleNamespace(max_model_len=max_model_len),
                             max_num_seqs=4)
    builder = fm.FlashInferMLAMetadataBuilder(mla_spec(PAGE, not causal, torch.float32),
                                              ["layer.0"], config, "cpu", dcp_rank=0,
                                              kernel_family="hopper")
    builder.reorder_batch_threshold = Q
    n = len(exact)
    case = make_case(exact, [Q] * n, num_heads=HEADS, causal=causal, seed=3, dtype=torch.float32)
    _, _, cm, _ = build_rank(case, fm.FlashInferMLAMetadataBuilder, 1, 0, 1, PAGE, fill=0.0,
                             builder_kwargs=dict(kernel_family="hopper"))
    upper_cm = replace(cm, cudagraph=True, seq_lens_cpu=torch.tensor(upper, dtype=torch.int32),
                       block_table_cpu=cm.block_table_cpu.clone())
    md = builder.build(0, upper_cm)
    slot = md.decode.backend_state.wrapper_slot
    # the first plan of a graph wrapper is made by the first layer's forward (what records the
    # layer arguments); later builds plan at build time, natively, and keep a skeleton
    fm._plan(slot, md.decode.backend_state.hopper_inputs, ("first",), num_heads=HEADS,
             head_dim_ckv=512, head_dim_kpe=64, page_size=PAGE, sm_scale=0.1,
             q_data_type=torch.float32, kv_data_type=torch.float32, lse_mode="basee")
    md = builder.build(0, upper_cm)
    assert slot.refresher is not None and slot.refresher.skeleton is not None
    ws = slot.wrapper._planned_backend._int_workspace_buffer.view(torch.int32)
    inputs = md.decode.backend_state.hopper_inputs
    qo, kv_indptr, _ = (a.copy() for a in inputs.arrays)

    def host_refresh(lengths) -> torch.Tensor:
        oracle = PlanRefresher(ws.clone(), max_works=slot.refresher.max_works)
        oracle.adopt(slot.refresher.skeleton)
        kv = np.zeros(qo.shape[0] - 1, dtype=kv_indptr.dtype)
        kv[:n] = lengths
        assert oracle.try_refresh(qo, kv_indptr, kv)
        return oracle.device_ws

    return builder, md, ws, host_refresh, upper_cm


def page_lists(table: torch.Tensor, lengths) -> tuple[list[int], list[int]]:
    """(kv_indptr, kv_indices) a host plan lists for these lengths over these table rows."""
    pages = [-(-g // PAGE) for g in lengths]
    indptr = np.concatenate([[0], np.cumsum(pages)]).tolist()
    return indptr, [int(v) for r, p in enumerate(pages) for v in table[r, :p]]


def expect_plan_for(md, ws, slot, lengths, causal: bool, csr_indptr,
                    exact_cut: bool = True) -> None:
    """The int workspace `ws` holds a plan for `lengths` that a fresh plan would cut the same
    way, with the works' first pages from `csr_indptr` (the CSR the kernels read). Not
    `exact_cut`: a draft plan, whose last chunk may have grown by the draft slack
    (refresh_slack) since it was made; it must still cover every request exactly."""
    inputs = md.decode.backend_state.hopper_inputs
    qo = inputs.arrays[0]
    kv = np.zeros(qo.shape[0] - 1, dtype=np.int64)
    kv[:len(lengths)] = lengths
    indptr = np.full(qo.shape[0], csr_indptr[-1], dtype=np.int64)
    indptr[:len(csr_indptr)] = csr_indptr
    info = list(slot.refresher.skeleton.info)
    works = plan_works(ws.numpy(), info)
    clusters = info[1]
    limit = limit_of(int(kv.sum()), clusters)
    counts = [-(-int(g) // limit) if g > limit else 1 for g in kv]
    if not exact_cut:
        assert_valid_plan(works, qo, kv, indptr, chunk_limit=limit,
                          last_chunk_limit=limit + refresh_slack(limit, draft=True))
        return
    assert_valid_plan(works, qo, kv, indptr, chunk_limit=limit, chunk_counts=counts)
    fresh_info, scratch, fresh_limit = model_plan(qo, kv, indptr, HEADS, num_sm=NUM_SM,
                                                  causal=causal)
    assert fresh_limit == limit
    cut = {(w["q_indptr"], w["kv_start"], w["kv_end"], w["kv_len"], w["kv_indptr"])
           for w in works}
    fresh = {(w["q_indptr"], w["kv_start"], w["kv_end"], w["kv_len"], w["kv_indptr"])
             for w in plan_works(scratch.view(torch.int32).numpy(), fresh_info)}
    assert cut == fresh
