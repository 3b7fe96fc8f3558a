"""FlashInferMLAMetadataBuilder.advance_decode_plan_on_device on the CPU: a CUDA-graph plan held
from one step carries the next (the early draft step with the device lowering,
BlockSpeculator.prepare_early) where its listed pages, page ids and chunk counts still hold;
it then writes the new lengths from the device buffer, leaving the int workspace as a host
refresh for those lengths would and the wrapper's kv_len_arr at them. Anything else is refused
and changes nothing. The wrapper is the plan-model stand-in (tests/utils/fake_flashinfer.py:
real plan layouts, FlashInfer's planner modelled), so skeletons and refreshes are the GPU's;
the GPU test (test_flashinfer_mla_gpu.py) checks the attention output itself."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.utils.fake_flashinfer import PlanModelWrapper, install_native_replan
from tests.utils.mla_dcp_helpers import build_rank, make_case, mla_spec, parallel_config

Q = 5  # a DSpark block of k = 4 drafts and its anchor: non-causal rows
PAGE = 16
# The plan is made one step earlier for UPPER (that step's bound); this step's device lengths
# are EXACT (past UPPER for every request), its bounds [LOWER, NEXT_UPPER] keep every request
# in the pages listed for UPPER (45, 129, 5, 1 pages of 16) and in its chunk count.
UPPER = [708, 2053, 70, 12]
EXACT = [712, 2056, 74, 14]
LOWER = [712, 2056, 74, 12]
NEXT_UPPER = [716, 2060, 78, 16]


@pytest.fixture
def held(monkeypatch):
    """(builder, metadata planned for UPPER with the device lengths at EXACT, the int
    workspace as int32, a host refresh of that workspace for lengths -> its bytes, the
    metadata input that planned it)."""
    install_native_replan(monkeypatch, PlanModelWrapper)
    from vllm.v1.attention.backends.mla import flashinfer_mla as fm
    from vllm.v1.attention.backends.mla.flashinfer_plan_refresh import PlanRefresher
    config = SimpleNamespace(parallel_config=parallel_config(1, 1).parallel_config,
                             model_config=SimpleNamespace(max_model_len=4096), max_num_seqs=4)
    builder = fm.FlashInferMLAMetadataBuilder(mla_spec(PAGE, True, torch.float32), ["layer.0"],
                                              config, "cpu", dcp_rank=0, kernel_family="hopper")
    builder.reorder_batch_threshold = Q
    case = make_case(EXACT, [Q] * 4, num_heads=16, causal=False, seed=3, dtype=torch.float32)
    _, _, cm, _ = build_rank(case, fm.FlashInferMLAMetadataBuilder, 1, 0, 1, PAGE, fill=0.0,
                             builder_kwargs=dict(kernel_family="hopper"))
    upper_cm = replace(cm, cudagraph=True, seq_lens_cpu=torch.tensor(UPPER, dtype=torch.int32),
                       block_table_cpu=cm.block_table_cpu.clone())
    md = builder.build(0, upper_cm)
    slot = md.decode.backend_state.wrapper_slot
    # the first plan of a graph wrapper is made by the first layer's forward (what records the
    # layer arguments); later builds plan at build time, natively, and keep a skeleton
    fm._plan(slot, md.decode.backend_state.hopper_inputs, ("first",), num_heads=16,
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
        kv[:4] = lengths
        assert oracle.try_refresh(qo, kv_indptr, kv)
        return oracle.device_ws

    return builder, md, ws, host_refresh, upper_cm


def _bounds(lower=LOWER, upper=NEXT_UPPER):
    return np.array(lower, dtype=np.int64), np.array(upper, dtype=np.int64)


def test_an_advance_writes_what_a_host_refresh_writes(held):
    builder, md, ws, host_refresh, _ = held
    expected = host_refresh(EXACT)
    assert not torch.equal(ws, expected)  # the held plan is at UPPER
    assert builder.advance_decode_plan_on_device(md, _bounds())
    assert torch.equal(ws, expected)
    kv_len_arr = md.decode.backend_state.wrapper_slot.wrapper._planned_backend._kv_len_arr_buf
    assert kv_len_arr[:4].tolist() == EXACT and not kv_len_arr[4:].any()
    assert md.decode.row_seq_lens_cpu is None  # the host rows of the earlier step are stale


@pytest.mark.parametrize("why", ["past the listed pages", "under a chunk edge",
                                 "another request's pages", "a later build"])
def test_a_refused_advance_changes_nothing(held, why):
    builder, md, ws, _, upper_cm = held
    lower, upper = _bounds()
    slot = md.decode.backend_state.wrapper_slot
    if why == "past the listed pages":
        upper[2] = 81  # 6 pages of 16: the plan lists 5 for request 2
    elif why == "under a chunk edge":
        skeleton = slot.refresher.skeleton
        multi = [i for i in range(skeleton.num_real) if skeleton.lo[i] > 0]
        assert multi, "request 1 (2053 tokens) spans several chunks"
        lower[multi[0]] = int(skeleton.lo[multi[0]])
    elif why == "another request's pages":
        table = md.decode.block_table_cpu  # the batch rows' host twin, read in place
        table[1, 3] += 1000
    else:  # the wrapper planned again since: md is not its latest plan
        builder.build(0, upper_cm)
    before = ws.clone()
    lowerings = slot.refresher.device_lowerings
    assert not builder.advance_decode_plan_on_device(md, (lower, upper))
    if why != "a later build":
        assert torch.equal(ws, before)
    assert slot.refresher.device_lowerings == lowerings


def test_the_same_step_lowering_shares_the_checks(held):
    """lower_decode_seq_lens_on_device (the plan built for this step's upper bound) is the
    advance with the planned lengths as the upper bound: a lower bound under them writes the
    device lengths as a host refresh would; one above them is refused, writing nothing."""
    builder, md, ws, host_refresh, _ = held
    before = ws.clone()
    assert not builder.lower_decode_seq_lens_on_device(md, np.array([709, 2053, 70, 12]))
    assert torch.equal(ws, before)
    assert builder.lower_decode_seq_lens_on_device(md, np.array([704, 2049, 66, 8]))
    assert torch.equal(ws, host_refresh(EXACT))
