"""FLASHINFER_MLA (Hopper, fa3) on a real GPU against TORCH_MLA and the float64 oracle.

DCP N in {1,2,4,8} is simulated on one GPU: the cache is sharded per rank, every rank's
decode runs, the partial states are merged with the LSE combine. Run on the H200 node:
    source .gpu/env.sh && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
    pytest -m gpu tests/attention -q
"""
import math

import pytest
import torch

from tests.utils.mla_dcp_helpers import build_rank, make_case, reference_decode
from vllm.v1.attention.backends.mla.flashinfer_mla import (FlashInferMLAImpl,
                                                           FlashInferMLAMetadataBuilder,
                                                           _import_flashinfer)
from vllm.v1.attention.backends.mla.torch_mla import TorchMLAImpl
from vllm.v1.attention.ops.dcp_combine import (correct_attn_out_torch, correct_attn_out_triton,
                                               merge_attn_states)

pytestmark = pytest.mark.gpu
HEADS, BLOCK = 16, 64
DEVICE = "cuda"
# bf16 inputs: FlashInfer vs exact reference differs by ~2.4e-3 (DESIGN §5)
O_TOL, LSE_TOL = 1e-2, 1e-2

KINDS = {
    "single": ([700, 2049, 64, 5], [1, 1, 1, 1], True),
    "verify": ([700, 2049, 64, 9], [4, 4, 4, 4], True),
    "varlen": ([700, 2049, 64, 9], [1, 5, 3, 2], True),
    "block": ([700, 2049, 64, 12], [8, 8, 8, 8], False),
}


@pytest.fixture(scope="module", autouse=True)
def hopper_with_flashinfer():
    pytest.importorskip("flashinfer", reason="source .gpu/env.sh first (installs flashinfer)")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FlashInfer Hopper (fa3) path needs an sm90 GPU")


def fi_rank(case, n, rank, mode="auto", natural_lse=True, interleave=1):
    md, cache, _, _ = build_rank(
        case, FlashInferMLAMetadataBuilder, n, rank, interleave, BLOCK, fill=0.0, device=DEVICE,
        builder_kwargs=dict(kernel_family="hopper", causal_mode=mode, natural_lse=natural_lse))
    q = case.q.to(DEVICE)
    fi = FlashInferMLAImpl(num_heads=HEADS, scale=case.scale).forward_decode(q, cache, md.decode)
    ref = TorchMLAImpl(num_heads=HEADS, scale=case.scale).forward_decode(q, cache, md.decode)
    return fi, ref


def assert_states_close(a, b, o_tol=O_TOL, lse_tol=LSE_TOL):
    (oa, la), (ob, lb) = a, b
    torch.testing.assert_close(oa.float(), ob.float(), rtol=o_tol, atol=o_tol)
    assert torch.equal(torch.isinf(la), torch.isinf(lb)), "empty rows must agree (LSE -inf)"
    torch.testing.assert_close(la.float(), lb.float(), rtol=1e-3, atol=lse_tol)


# The causal plan mode ("runs" vs "flattened") only matters for multi-token causal rows, so the
# other query kinds run in "auto" mode alone.
KIND_MODES = [(kind, mode) for kind in KINDS
              for mode in (("auto",) if kind in ("single", "block") else ("auto", "runs", "flattened"))]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("kind,mode", KIND_MODES)
def test_hopper_matches_torch_mla_and_dcp_merge(kind, mode, n):
    seq_lens, qlens, causal = KINDS[kind]
    case = make_case(seq_lens, qlens, num_heads=HEADS, causal=causal, seed=n,
                     dtype=torch.bfloat16)
    fi_parts, ref_parts = [], []
    for r in range(n):
        fi, ref = fi_rank(case, n, r, mode)
        assert_states_close(fi, ref)  # per rank, including rows that are empty on this rank
        fi_parts.append(fi)
        ref_parts.append(ref)
    merged_o, merged_lse = merge_attn_states(torch.stack([p[0] for p in fi_parts]),
                                             torch.stack([p[1] for p in fi_parts]))
    dense_o, dense_lse = reference_decode(case)  # float64, no paging, no DCP
    if n > 1:  # DCP=N merged equals the DCP=1 FlashInfer result
        single = fi_rank(case, 1, 0, mode)[0]
        assert_states_close((merged_o, merged_lse), single)
    torch.testing.assert_close(merged_o.double().cpu(), dense_o, rtol=O_TOL, atol=O_TOL)
    torch.testing.assert_close(merged_lse.double().cpu(), dense_lse, rtol=1e-3, atol=LSE_TOL)


def test_runs_plan_equals_flattened_plan():
    case = make_case([3000, 517, 70], [8, 8, 8], num_heads=HEADS, causal=True, seed=11,
                     dtype=torch.bfloat16)
    for r in range(4):
        runs, _ = fi_rank(case, 4, r, "runs")
        flat, _ = fi_rank(case, 4, r, "flattened")
        assert_states_close(runs, flat, o_tol=5e-3, lse_tol=5e-3)


@pytest.mark.parametrize("natural_lse", [True, False])
def test_lse_modes_give_natural_log(natural_lse):
    case = make_case([900, 33], [4, 4], num_heads=HEADS, causal=True, seed=5,
                     dtype=torch.bfloat16)
    for r in range(2):
        fi, ref = fi_rank(case, 2, r, "runs", natural_lse=natural_lse)
        assert_states_close(fi, ref)


def test_raw_wrapper_lse_base2_vs_basee():
    """The kernel's default LSE is base 2 (= natural / ln 2); lse_mode="basee" is natural."""
    fi = _import_flashinfer()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    kv_len, pages = 300, 5
    cache = torch.randn(pages, BLOCK, 576, device=DEVICE, generator=gen).bfloat16()
    q = torch.randn(2, HEADS, 576, device=DEVICE, generator=gen).bfloat16()
    meta = fi.mla.MLAPlanMetadata.csr(torch.tensor([0, 2], dtype=torch.int32),
                                      torch.tensor([0, pages], dtype=torch.int32),
                                      torch.arange(pages, dtype=torch.int32),
                                      torch.tensor([kv_len], dtype=torch.int32))
    scale = 1 / math.sqrt(192)
    lses = {}
    for mode in ("base2", "basee"):
        wrapper = fi.mla.BatchMLAPagedAttentionWrapper(
            torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=DEVICE), backend="fa3")
        wrapper.plan(metadata=meta, num_heads=HEADS, head_dim_ckv=512, head_dim_kpe=64,
                     page_size=BLOCK, causal=False, sm_scale=scale, q_data_type=torch.bfloat16,
                     kv_data_type=torch.bfloat16, lse_mode=mode)
        _, lses[mode] = wrapper.run(query=q, kv_cache=cache, return_lse=True,
                                    return_lse_base_on_e=(mode == "basee"))
    kv = cache.reshape(-1, 576)[:kv_len].double()
    exact = torch.logsumexp(q.double() @ kv.T * scale, -1).float()
    torch.testing.assert_close(lses["basee"], exact, rtol=1e-3, atol=1e-2)
    torch.testing.assert_close(lses["base2"] * math.log(2.0), exact, rtol=1e-3, atol=1e-2)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("base_e", [True, False])
def test_triton_merge_matches_torch_on_gpu(n, base_e):
    gen = torch.Generator(device=DEVICE).manual_seed(n)
    out = torch.randn(64, 128, 512, device=DEVICE, generator=gen).bfloat16()
    lses = torch.randn(n, 64, 128, device=DEVICE, generator=gen) * 5
    lses[0, :3] = float("nan")
    lses[:, 5] = float("-inf")
    lses[-1, 7] = float("inf")
    out[5] = float("nan")
    for rank in range(n):
        ref_o, ref_l = correct_attn_out_torch(out, lses, rank, base_e)
        got_o, got_l = correct_attn_out_triton(out, lses, rank, base_e)
        torch.testing.assert_close(got_o.float(), ref_o.float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got_l, ref_l.float(), rtol=1e-5, atol=1e-5)
        assert not torch.isnan(got_o).any()


def _graph_builder(qlen: int, non_causal: bool, max_model_len: int):
    """One FlashInfer builder whose decode steps are built in graph mode (fixed padded size)."""
    from types import SimpleNamespace

    from tests.utils.mla_dcp_helpers import mla_spec, parallel_config
    config = SimpleNamespace(parallel_config=parallel_config(1, 1).parallel_config,
                             model_config=SimpleNamespace(max_model_len=max_model_len),
                             max_num_seqs=8)
    builder = FlashInferMLAMetadataBuilder(mla_spec(BLOCK, non_causal, torch.bfloat16),
                                           ["layer.0"], config, DEVICE, dcp_rank=0,
                                           kernel_family="hopper")
    builder.reorder_batch_threshold = qlen
    return builder


def _graph_step(builder, seq_lens, qlens, causal: bool, seed: int):
    """Build one graph-mode step on `builder` and run it through FLASHINFER_MLA and TORCH_MLA
    on the same metadata: (metadata, FlashInfer state, TORCH_MLA state)."""
    from dataclasses import replace
    case = make_case(seq_lens, qlens, num_heads=HEADS, causal=causal, seed=seed,
                     dtype=torch.bfloat16)
    _, cache, cm, _ = build_rank(case, FlashInferMLAMetadataBuilder, 1, 0, 1, BLOCK,
                                 fill=0.0, device=DEVICE,
                                 builder_kwargs=dict(kernel_family="hopper"))
    md = builder.build(0, replace(cm, cudagraph=True))
    q = torch.zeros(md.decode.num_decode_tokens, HEADS, case.q.shape[-1],
                    dtype=case.q.dtype, device=DEVICE)
    q[: case.q.shape[0]] = case.q.to(DEVICE)
    fi = FlashInferMLAImpl(num_heads=HEADS, scale=case.scale).forward_decode(q, cache, md.decode)
    ref = TorchMLAImpl(num_heads=HEADS, scale=case.scale).forward_decode(q, cache, md.decode)
    return md, fi, ref


@pytest.mark.parametrize("own_copy", [False, True])
@pytest.mark.parametrize("qlen", [1, 4])
def test_graph_wrapper_native_replans_with_the_packed_copy_match_torch_mla(qlen, own_copy,
                                                                         monkeypatch):
    """One builder over several graph-mode steps of the same padded size: the first plan is a
    full FlashInfer plan, the later ones are native re-plans (or plan refreshes) that move the
    CSR into the graph wrapper's packed buffers in ONE copy; every step must still equal TORCH_MLA on the same
    metadata (eager run() on the graph wrapper reads exactly those buffers). `own_copy`: the
    re-plans copy the planner's workspace bytes themselves (VLLM_MLA_NATIVE_PLAN_OWN_COPY)."""
    import vllm.v1.attention.backends.mla.flashinfer_mla as fm
    monkeypatch.setenv(fm.OWN_PLAN_COPY_FLAG, "1" if own_copy else "0")
    own_copies = []
    plan_and_stage = fm._plan_and_stage
    monkeypatch.setattr(fm, "_plan_and_stage",
                        lambda *a: own_copies.append(1) or plan_and_stage(*a))
    builder = _graph_builder(qlen, non_causal=False, max_model_len=4096)
    for step, seq_lens in enumerate(([700, 2049, 64, 9], [701, 2050, 65, 0],
                                     [1500, 3, 64, 1000], [1501, 4, 65, 1001])):
        qlens = [qlen if g else 0 for g in seq_lens]  # a zero row: graph padding
        md, fi, ref = _graph_step(builder, [max(g, 0) for g in seq_lens], qlens, True, 20 + step)
        assert_states_close(fi, ref)
        slot = md.decode.backend_state.wrapper_slot
        assert slot.packed_device is not None
        if step:
            assert md.decode.backend_state.hopper_inputs.packed is not None
    # steps 1 and 3 only grow the lengths by one: refreshed instead of re-planned
    assert slot.native_replans + slot.refreshes >= 3 and slot.full_plans == 1
    assert slot.native_replans >= 1 and bool(own_copies) == own_copy  # the path under test


@pytest.mark.parametrize("qlen,causal", [(1, True), (4, False), (4, True), (5, True)])
def test_graph_wrapper_plan_refreshes_match_torch_mla(qlen, causal):
    """Steady decode on one graph wrapper: lengths grow by one per step, so after the first plan
    the builder refreshes the plan's length-dependent work arrays instead of re-planning
    (flashinfer_plan_refresh.py). Every step must equal TORCH_MLA; a jump that changes a
    request's chunk count, and a step with other rows, must be planned anew (by FlashInfer, on
    the host: flashinfer_host_plan.py, or, back in rows and a structure planned before, put
    back from the plan cache: flashinfer_plan_cache.py)."""
    builder = _graph_builder(qlen, non_causal=not causal, max_model_len=8192)
    seq = [700, 2049, 64, 9]
    planned_before = 0
    for step in range(24):
        if step == 12:
            seq[0] += 1500  # many more chunks for request 0: a real plan
        live = [g for g in seq]
        if step == 18:
            live[3] = 0  # a padding row this step: other query rows, a real plan
        qlens = [qlen if g else 0 for g in live]
        md, fi, ref = _graph_step(builder, live, qlens, causal, 40 + step)
        assert_states_close(fi, ref)
        slot = md.decode.backend_state.wrapper_slot
        planned = (slot.native_replans + slot.full_plans + slot.host_plans
                   + slot.refresher.cache_put_backs)
        if step in (12, 18, 19):
            assert planned > planned_before, f"step {step} must be planned for real"
        planned_before = planned
        seq = [g + 1 for g in seq]
    assert slot.refreshes >= 18, (slot.refreshes, slot.native_replans, slot.full_plans)


@pytest.mark.parametrize("qlen,causal", [(1, True), (5, False)])
def test_refreshed_last_chunks_past_the_chunk_limit_match_torch_mla(qlen, causal, monkeypatch):
    """A refresh lets a request's last chunk grow past FlashInfer's kv_len_limit, up to the
    refresh slack (flashinfer_plan_refresh.py, VLLM_MLA_REFRESH_SLACK_TOKENS=128 here: drifted
    batches would otherwise re-plan once per request per chunk edge). The kernels loop over each
    work's own KV range, so such a plan must still equal TORCH_MLA; one token more than the
    slack allows is planned for real (natively or on the host)."""
    from vllm.v1.attention.backends.mla.flashinfer_plan_refresh import (REFRESH_SLACK_TOKENS,
                                                                         SLACK_FLAG)
    monkeypatch.setenv(SLACK_FLAG, str(REFRESH_SLACK_TOKENS))
    builder = _graph_builder(qlen, non_causal=not causal, max_model_len=8192)
    seq = [700, 2049, 64, 9]
    md, fi, ref = _graph_step(builder, seq, [qlen] * 4, causal, 90)
    assert_states_close(fi, ref)
    slot = md.decode.backend_state.wrapper_slot
    skeleton = slot.refresher.skeleton
    assert skeleton is not None and skeleton.limit > 0
    def plans():
        return slot.native_replans + slot.full_plans + slot.host_plans

    planned = plans()
    # every request at the longest length its held plan allows
    grown = [int(h) for h in skeleton.hi[: skeleton.num_real]]
    past = [g - max(int(lo), 0) for g, lo in zip(grown, skeleton.lo)]  # some last chunks
    assert max(past) > skeleton.limit, (grown, skeleton.limit)
    md, fi, ref = _graph_step(builder, grown, [qlen] * 4, causal, 91)
    assert_states_close(fi, ref)
    assert plans() == planned  # refreshed, not re-planned
    grown[0] += 1
    md, fi, ref = _graph_step(builder, grown, [qlen] * 4, causal, 92)
    assert_states_close(fi, ref)
    assert plans() == planned + 1


def _upper_bound_plan_case(plan_seed: int, case_seed: int,
                           exact=(704, 2050, 66, 12), upper=(708, 2053, 70, 12)):
    """A DSpark block step (k = 4, non-causal Q=5 rows) whose graph plan is built for the
    upper-bound host lengths `upper` (default [708, 2053, 70, 12]: every draft accepted;
    request 2 lists one page more, 70 > 64; request 3 as is) while the device lengths are
    `exact` (default [704, 2050, 66, 12]). Returns (builder, the upper-bound metadata input,
    run(md) -> (FlashInfer, TORCH_MLA) outputs, real query rows)."""
    from dataclasses import replace
    q_len = 5
    builder = _graph_builder(q_len, non_causal=True, max_model_len=8192)
    _graph_step(builder, [700, 2049, 64, 9], [q_len] * 4, False, plan_seed)  # plan_args
    exact, upper = list(exact), list(upper)
    case = make_case(exact, [q_len] * 4, num_heads=HEADS, causal=False, seed=case_seed,
                     dtype=torch.bfloat16)
    # Unwritten cache slots hold 4.0 (finite: kernels load whole tiles and mask), so tokens
    # read past a length move the result by far more than rounding.
    _, cache, cm, _ = build_rank(case, FlashInferMLAMetadataBuilder, 1, 0, 1, BLOCK,
                                 fill=4.0, device=DEVICE,
                                 builder_kwargs=dict(kernel_family="hopper"))
    table = torch.zeros(4, 2 + cm.block_table_cpu.shape[1], dtype=torch.int32)
    table[:, : cm.block_table_cpu.shape[1]] = cm.block_table_cpu  # room for the bound's pages
    upper_cm = replace(cm, cudagraph=True, seq_lens_cpu=torch.tensor(upper, dtype=torch.int32),
                       block_table_cpu=table)

    def run(md):
        q = torch.zeros(md.decode.num_decode_tokens, HEADS, case.q.shape[-1],
                        dtype=case.q.dtype, device=DEVICE)
        q[: case.q.shape[0]] = case.q.to(DEVICE)
        fi = FlashInferMLAImpl(num_heads=HEADS, scale=case.scale).forward_decode(
            q, cache, md.decode)
        ref = TorchMLAImpl(num_heads=HEADS, scale=case.scale).forward_decode(
            q, cache, md.decode)
        return fi, ref

    return builder, upper_cm, run, case.q.shape[0]


def test_a_graph_plan_for_upper_bound_lengths_lowered_on_the_device_matches_torch_mla():
    """The early draft step's device lowering (VLLM_EARLY_DRAFT_DEVICE_LOWERING=1): the plan is
    made for upper-bound host lengths while the metadata's device seq_lens hold the exact ones;
    lower_decode_seq_lens_on_device, given only the host's lower bound (every draft rejected),
    rewrites the plan from the device lengths, and FlashInfer then equals TORCH_MLA on them.
    A lower bound below a chunk's lower edge is refused and changes nothing."""
    import numpy as np
    lower = [704, 2049, 66, 8]  # at most k = 4 below the bound, at or under the exact lengths
    builder, upper_cm, run, rows = _upper_bound_plan_case(72, 73)
    md = builder.build(0, upper_cm)
    fi, ref = run(md)
    assert not torch.allclose(fi[1][:rows].float(), ref[1][:rows].float(),
                              atol=1e-2)  # the upper bound's extra tokens were read
    assert builder.lower_decode_seq_lens_on_device(md, np.array(lower))
    fi, ref = run(md)
    assert_states_close(fi, ref)

    md = builder.build(0, upper_cm)
    state = md.decode.backend_state
    skeleton = state.wrapper_slot.refresher.skeleton
    multi = [i for i in range(skeleton.num_real) if skeleton.lo[i] > 0]
    assert multi, "request 1 (2053 tokens) must span several chunks"
    too_low = list(lower)
    too_low[multi[0]] = int(skeleton.lo[multi[0]])
    lowerings = state.wrapper_slot.refresher.device_lowerings
    assert not builder.lower_decode_seq_lens_on_device(md, np.array(too_low))
    assert state.wrapper_slot.refresher.device_lowerings == lowerings


def test_a_plan_held_from_the_previous_step_advanced_on_the_device_matches_torch_mla(
        monkeypatch):
    """The early draft step's advance (BlockSpeculator.prepare_early with the device lowering):
    a plan built one step earlier for that step's upper bounds [708, 2053, 70, 12] carries
    this step, whose exact device lengths [712, 2056, 74, 14] outgrew them, while every length
    between this step's bounds keeps the listed pages and the chunk counts.
    advance_decode_plan_on_device writes them from the device and FlashInfer then equals
    TORCH_MLA on them. Refused, changing nothing: a lower bound under a chunk's edge. A row
    whose listed pages are not its pages any more (its host twin says another request's
    pages are there) gets its page lists rebuilt from the device block table (which holds
    this case's pages) in the same advance (VLLM_PLAN_PAGE_LIST_REBUILD=1), and the result
    still equals TORCH_MLA."""
    import numpy as np

    from vllm.v1.attention.backends.mla.flashinfer_mla import PAGE_LIST_REBUILD_FLAG
    monkeypatch.setenv(PAGE_LIST_REBUILD_FLAG, "1")  # the default, pinned (read per builder)
    builder, upper_cm, run, rows = _upper_bound_plan_case(
        74, 75, exact=(712, 2056, 74, 14), upper=(708, 2053, 70, 12))
    md = builder.build(0, upper_cm)
    fi, ref = run(md)
    assert not torch.allclose(fi[1][:rows].float(), ref[1][:rows].float(),
                              atol=1e-2)  # the held plan stops at the earlier lengths
    refresher = md.decode.backend_state.wrapper_slot.refresher
    skeleton = refresher.skeleton
    lower, upper = np.array([712, 2056, 74, 12]), np.array([716, 2060, 78, 16])
    before, rebuilds = refresher.device_lowerings, refresher.page_list_rebuilds
    multi = [i for i in range(skeleton.num_real) if skeleton.lo[i] > 0]
    assert multi, "request 1 (2053 tokens) must span several chunks"
    under_edge = lower.copy()
    under_edge[multi[0]] = int(skeleton.lo[multi[0]])
    assert not builder.advance_decode_plan_on_device(md, (under_edge, upper))
    assert refresher.device_lowerings == before  # the refusal wrote nothing
    table = md.decode.block_table_cpu
    held_page = int(table[1, 0])
    table[1, 0] = held_page + 1  # the host twin: row 1 holds other pages
    assert builder.advance_decode_plan_on_device(md, (lower, upper))
    table[1, 0] = held_page
    assert refresher.device_lowerings == before + 1
    assert refresher.page_list_rebuilds == rebuilds + 1
    fi, ref = run(md)
    assert_states_close(fi, ref)


def _carried_step(non_causal: bool, previous, nxt, plan_seed: int, case_seed: int):
    """A Q=5 graph step (verify rows, causal; or draft blocks, non-causal) built for lengths
    `previous` on a builder that planned once before, whose device lengths then move to `nxt`
    (what the batch builder writes into the buffer the metadata aliases), and TORCH_MLA on
    metadata built afresh for `nxt` as the reference; the KV cache past every length holds
    4.0. Returns (builder, the carried metadata, run(impl, decode), reference, query rows)."""
    from dataclasses import replace
    q_len = 5
    builder = _graph_builder(q_len, non_causal=non_causal, max_model_len=8192)
    _graph_step(builder, [690, 2030, 50, 5], [q_len] * 4, not non_causal, plan_seed)
    case = make_case(nxt, [q_len] * 4, num_heads=HEADS, causal=not non_causal, seed=case_seed,
                     dtype=torch.bfloat16)
    _, cache, cm, _ = build_rank(case, FlashInferMLAMetadataBuilder, 1, 0, 1, BLOCK, fill=4.0,
                                 device=DEVICE, builder_kwargs=dict(kernel_family="hopper"))
    graph_cm = replace(cm, cudagraph=True)
    q = torch.zeros(4 * q_len, HEADS, case.q.shape[-1], dtype=case.q.dtype, device=DEVICE)
    q[: case.q.shape[0]] = case.q.to(DEVICE)

    def run(impl, decode):
        return impl(num_heads=HEADS, scale=case.scale).forward_decode(q, cache, decode)

    fresh = _graph_builder(q_len, non_causal=non_causal, max_model_len=8192)
    ref = run(TorchMLAImpl, fresh.build(0, graph_cm).decode)
    # the earlier step: its lengths on the host and in the device buffer, then the next's
    cm.seq_lens.copy_(torch.tensor(previous, dtype=cm.seq_lens.dtype))
    md = builder.build(0, replace(graph_cm,
                                  seq_lens_cpu=torch.tensor(previous, dtype=torch.int32)))
    cm.seq_lens.copy_(torch.tensor(nxt, dtype=cm.seq_lens.dtype))
    assert md.decode.seq_lens.data_ptr() == cm.seq_lens.data_ptr()
    return builder, md, run, ref, case.q.shape[0]


@pytest.mark.parametrize("crossing", [False, True], ids=["same-pages", "into-a-new-page"])
@pytest.mark.parametrize("non_causal", [False, True], ids=["verify-causal", "draft-noncausal"])
def test_a_graph_step_carried_to_the_next_step_matches_torch_mla(non_causal, crossing,
                                                                 monkeypatch):
    """The runner's graph-step advance (GPUModelRunner._advance_graph_step): metadata built
    for one graph step (lengths [700, 2040, 60, 9]) carries the next (every request one to
    four tokens longer, in the same chunks; `crossing`: request 2 grows from 60 to 70 tokens,
    into a second page of 64 that the held plan does not list, so the page lists are rebuilt
    on the device), whose lengths the batch builder has written into the device buffer the
    metadata aliases. advance_graph_step writes them into the plan and the row lengths;
    FlashInfer and TORCH_MLA on the carried metadata then equal TORCH_MLA on metadata built
    afresh for the next step. Before the advance FlashInfer still reads the earlier lengths
    (it must differ, so the check can fail). Verify rows (causal Q=5) and draft blocks
    (non-causal Q=5)."""
    import numpy as np
    from vllm.v1.attention.backends.mla.flashinfer_mla import PAGE_LIST_REBUILD_FLAG
    monkeypatch.setenv(PAGE_LIST_REBUILD_FLAG, "1")  # the default, pinned (read per builder)
    nxt = [704, 2044, 70 if crossing else 64, 13]
    builder, md, run, ref, rows = _carried_step(non_causal, [700, 2040, 60, 9], nxt, 81, 82)
    stale = run(FlashInferMLAImpl, md.decode)
    assert not torch.allclose(stale[1][:rows].float(), ref[1][:rows].float(),
                              atol=1e-2)
    refresher = md.decode.backend_state.wrapper_slot.refresher
    rebuilds = refresher.page_list_rebuilds
    assert builder.advance_graph_step(md, np.array(nxt, dtype=np.int32))
    assert refresher.page_list_rebuilds == rebuilds + int(crossing)
    assert_states_close(run(FlashInferMLAImpl, md.decode), ref)
    assert_states_close(run(TorchMLAImpl, md.decode), ref)


@pytest.mark.parametrize("lookahead", [True, False], ids=["lookahead", "own-pages"])
def test_page_lists_rebuilt_with_a_lookahead_carry_later_steps_and_match_torch_mla(
        lookahead, monkeypatch):
    """VLLM_PLAN_PAGE_LIST_LOOKAHEAD on the GPU: a graph step carried from lengths
    [636, 2040, 62, 9] to [639, 2044, 66, 13] (request 2 into a second page of 64: rebuilt)
    lists, with the lookahead, 4 tokens' pages more (row 1 holds 32 pages, 2048 tokens, the
    fewest ahead), so the next carry to [643, 2046, 69, 14] (request 0 into an 11th page)
    needs no rebuild; without it that carry rebuilds. FlashInfer on the carried metadata, whose
    lists then hold pages past the lengths, equals TORCH_MLA on it at both steps, and at the
    last step TORCH_MLA on metadata built afresh (the pages past each length hold KV of 4.0,
    so a read of them would show)."""
    import numpy as np
    from dataclasses import replace
    from vllm.v1.attention.backends.mla.flashinfer_mla import (PAGE_LIST_LOOKAHEAD_FLAG,
                                                               PAGE_LIST_REBUILD_FLAG)
    monkeypatch.setenv(PAGE_LIST_REBUILD_FLAG, "1")
    monkeypatch.setenv(PAGE_LIST_LOOKAHEAD_FLAG, "1" if lookahead else "0")
    q_len, previous, nxt, last = 5, [636, 2040, 62, 9], [639, 2044, 66, 13], [643, 2046, 69, 14]
    builder = _graph_builder(q_len, non_causal=False, max_model_len=8192)
    _graph_step(builder, [630, 2030, 50, 5], [q_len] * 4, True, 91)  # plan_args
    case = make_case(last, [q_len] * 4, num_heads=HEADS, causal=True, seed=92,
                     dtype=torch.bfloat16)
    _, cache, cm, _ = build_rank(case, FlashInferMLAMetadataBuilder, 1, 0, 1, BLOCK, fill=4.0,
                                 device=DEVICE, builder_kwargs=dict(kernel_family="hopper"))
    held = np.array([-(-g // BLOCK) for g in last], dtype=np.int32)  # [11, 32, 2, 1]
    graph_cm = replace(cm, cudagraph=True, num_blocks_cpu=held)
    q = torch.zeros(4 * q_len, HEADS, case.q.shape[-1], dtype=case.q.dtype, device=DEVICE)
    q[: case.q.shape[0]] = case.q.to(DEVICE)
    rows = case.q.shape[0]

    def run(impl, decode):
        return impl(num_heads=HEADS, scale=case.scale).forward_decode(q, cache, decode)

    ref = run(TorchMLAImpl, _graph_builder(q_len, non_causal=False,
                                           max_model_len=8192).build(0, graph_cm).decode)
    cm.seq_lens.copy_(torch.tensor(previous, dtype=cm.seq_lens.dtype))
    md = builder.build(0, replace(graph_cm,
                                  seq_lens_cpu=torch.tensor(previous, dtype=torch.int32)))
    refresher = md.decode.backend_state.wrapper_slot.refresher
    rebuilds = refresher.page_list_rebuilds
    for step, (lengths, rebuilt) in enumerate(((nxt, 1), (last, 1 if lookahead else 2))):
        cm.seq_lens.copy_(torch.tensor(lengths, dtype=cm.seq_lens.dtype))
        assert builder.advance_graph_step(md, np.array(lengths, dtype=np.int32)), step
        assert refresher.page_list_rebuilds == rebuilds + rebuilt, step
        fi = run(FlashInferMLAImpl, md.decode)
        assert_states_close((fi[0][:rows], fi[1][:rows]),
                            tuple(t[:rows] for t in run(TorchMLAImpl, md.decode)))
    backend = md.decode.backend_state.wrapper_slot.wrapper._planned_backend
    listed = backend._kv_indptr_buf[:5].diff().tolist()
    assert listed == ([-(-(g + 4) // BLOCK) for g in nxt] if lookahead
                      else [-(-g // BLOCK) for g in last])
    assert_states_close(run(FlashInferMLAImpl, md.decode), ref)


def test_a_graph_plan_for_upper_bound_lengths_lowered_in_place_matches_torch_mla():
    """A block drafter's metadata built while the verify step runs (early_draft.py): the host
    plans for upper-bound lengths (every draft accepted) while the device already holds the
    exact ones; refresh_decode_seq_lens then lowers the plan to the exact lengths. Before the
    lowering FlashInfer reads the extra tokens (it must differ from TORCH_MLA on the exact
    lengths, so the check below can fail); after it, it equals TORCH_MLA. A lowering that
    would change a request's chunk count is refused and changes nothing."""
    import numpy as np
    exact = [704, 2050, 66, 12]
    builder, upper_cm, run, rows = _upper_bound_plan_case(70, 71)
    md = builder.build(0, upper_cm)
    fi, ref = run(md)
    assert not torch.allclose(fi[1][:rows].float(), ref[1][:rows].float(),
                              atol=1e-2)  # the upper bound's extra tokens were read
    assert builder.refresh_decode_seq_lens(md, np.array(exact))
    fi, ref = run(md)
    assert_states_close(fi, ref)

    # Refused: a length at or below a chunk's lower edge would drop a chunk.
    md = builder.build(0, upper_cm)
    state = md.decode.backend_state
    skeleton = state.wrapper_slot.refresher.skeleton
    kv_len_before = state.hopper_inputs.arrays[2].copy()
    multi = [i for i in range(skeleton.num_real) if skeleton.lo[i] > 0]
    assert multi, "request 1 (2053 tokens) must span several chunks"
    too_short = list(exact)
    too_short[multi[0]] = int(skeleton.lo[multi[0]])
    assert not builder.refresh_decode_seq_lens(md, np.array(too_short))
    assert np.array_equal(state.hopper_inputs.arrays[2], kv_len_before)


@pytest.mark.parametrize("qlen,causal", [(1, True), (5, True), (5, False)])
def test_which_cluster_computes_a_chunk_changes_no_output_bit(qlen, causal):
    """Whether a plan written on the host could stand in for FlashInfer's planner when a
    request's chunk count changes (docs/performance.md, thirty-first session: natively
    re-planned steps are two thirds of what a drifted B=8 batch loses where drafting cannot
    pay). Such a plan would cut the same chunks and lay out the same partials, but deal them
    to clusters its own way. So: FlashInfer's own plan (request 1 of 2049 tokens split into
    chunks merged from partials), its work items dealt to the clusters in reverse order
    (tests/utils/flashinfer_mla_plan_model.permute_clusters), must give the same output and
    LSE bit for bit. The kernels do read the permuted arrays: a chunk cut short by 16 tokens
    changes the output."""
    from dataclasses import replace

    from tests.utils.flashinfer_mla_plan_model import FIELDS, permute_clusters, plan_works
    builder = _graph_builder(qlen, non_causal=not causal, max_model_len=8192)
    _graph_step(builder, [690, 2030, 50, 5], [qlen] * 4, causal, 93)  # plan_args
    case = make_case([700, 2049, 64, 9], [qlen] * 4, num_heads=HEADS, causal=causal, seed=94,
                     dtype=torch.bfloat16)
    _, cache, cm, _ = build_rank(case, FlashInferMLAMetadataBuilder, 1, 0, 1, BLOCK, fill=0.0,
                                 device=DEVICE, builder_kwargs=dict(kernel_family="hopper"))
    md = builder.build(0, replace(cm, cudagraph=True))
    q = torch.zeros(md.decode.num_decode_tokens, HEADS, case.q.shape[-1], dtype=case.q.dtype,
                    device=DEVICE)
    q[: case.q.shape[0]] = case.q.to(DEVICE)
    impl = FlashInferMLAImpl(num_heads=HEADS, scale=case.scale)

    def run():
        out, lse = impl.forward_decode(q, cache, md.decode)
        torch.cuda.synchronize()
        return out.clone(), lse.clone()

    def same(a, b):
        return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    base = run()
    backend = md.decode.backend_state.wrapper_slot.wrapper._planned_backend
    ws = backend._int_workspace_buffer.view(torch.int32)
    info = [int(v) for v in backend._plan_info]
    planned = ws.clone()
    assert same(run(), base) and torch.equal(ws, planned)  # deterministic; no re-plan
    works = plan_works(planned.cpu().numpy(), info)
    assert any(w["partial_indptr"] >= 0 for w in works), "no request was split"
    start = info[2 + FIELDS.index("work_indptr")] // 4
    indptr = planned[start:start + info[1] + 1].tolist()
    assert sum(1 for c in range(info[1]) if indptr[c + 1] > indptr[c]) > 1
    permute_clusters(ws, info, list(reversed(range(info[1]))))
    assert not torch.equal(ws, planned)
    assert same(run(), base), "the output depends on which cluster computes a chunk"
    # the kernels read these arrays: cut a split request's first chunk short
    ws.copy_(planned)
    end = info[2 + FIELDS.index("kv_end")] // 4
    first = next(j for j, w in enumerate(works)
                 if w["partial_indptr"] >= 0 and w["kv_start"] == 0)
    ws[end + first] -= 16
    assert not same(run(), base)


@pytest.mark.parametrize("causal", [False, True])
def test_host_written_plans_are_flashinfers_byte_for_byte(causal):
    """flashinfer_host_plan.mla_plan against FlashInfer's own planner (the JIT module's plan,
    which writes the page-locked int scratch) on 300 random batches: one to 40 requests of 0
    to 12 query rows (so one- and two-CTA clusters, single- and multi-tile requests, padding
    requests) and 0 to 6000 KV tokens (split and unsplit, empty), at 16, 64 and 128 heads.
    Every array the kernels read must be equal (the per-work arrays up to the work count, the
    merge arrays' num_SMs entries, work_indptr), and the plan_info's cluster fields. This is
    what makes the cluster a host-written plan deals a chunk to FlashInfer's own."""
    import numpy as np

    from tests.utils.flashinfer_mla_plan_model import FIELDS, MERGE_FIELDS
    from vllm.v1.attention.backends.mla.flashinfer_host_plan import mla_plan
    builder = _graph_builder(1, non_causal=False, max_model_len=8192)
    md, _, _ = _graph_step(builder, [700, 2049, 64, 9], [1] * 4, True, 95)
    backend = md.decode.backend_state.wrapper_slot.wrapper._planned_backend
    raw_plan = backend._cached_module._module.plan
    pinned = backend._pin_memory_int_workspace_buffer
    num_sm = torch.cuda.get_device_properties(0).multi_processor_count
    torch.cuda.synchronize()  # the scratch's last copy to the device is done
    rng = np.random.default_rng(7 + causal)
    checked = split = multi_tile = 0
    for trial in range(300):
        batch = int(rng.integers(1, 41))
        heads = int(rng.choice([16, 64, 128]))
        q_lens = rng.integers(0, 13, batch)
        q_lens[rng.random(batch) < 0.2] = 0
        kv = rng.integers(0, 6001, batch) * (q_lens > 0)
        if trial % 3 == 0:
            kv = rng.integers(1, 300, batch) * (q_lens > 0)  # short: unsplit, 1-CTA limits
        qo = torch.from_numpy(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
        pages = -(-kv // BLOCK)
        kv_indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(pages)]).astype(np.int32))
        kv_len = torch.from_numpy(kv.astype(np.int32))
        info, _ = raw_plan(backend._float_workspace_buffer, backend._int_workspace_buffer,
                           pinned, qo, kv_indptr, kv_len, heads, 512, causal)
        info = [int(v) for v in info]
        plan = mla_plan(qo.numpy(), kv_indptr.numpy(), kv, heads, num_sm, causal)
        assert plan is not None
        assert info[:2] == [plan.cluster_size, plan.num_clusters], trial
        ws = pinned.view(torch.int32).numpy()
        at = dict(zip(FIELDS, info[2:16]))
        num_works = plan.work_indptr[-1]
        clusters = info[1]
        wi = ws[at["work_indptr"] // 4: at["work_indptr"] // 4 + clusters + 1]
        assert wi.tolist() == plan.work_indptr, trial
        for f, values in plan.works.items():
            got = ws[at[f] // 4: at[f] // 4 + num_works].tolist()
            assert got == values, (trial, f)
        for k, f in enumerate(MERGE_FIELDS):
            got = ws[at[f] // 4: at[f] // 4 + num_sm].tolist()
            want = [m[k] for m in plan.merges] + [0] * (num_sm - len(plan.merges))
            assert got == want, (trial, f)
        checked += 1
        split += bool(plan.merges)
        multi_tile += any(q * heads > 64 * plan.cluster_size for q in q_lens)
    assert checked == 300 and split > 50 and multi_tile > 50, (split, multi_tile)


@pytest.mark.parametrize("non_causal", [False, True], ids=["verify-causal", "draft-noncausal"])
def test_an_advance_into_a_structure_never_planned_takes_a_host_plan_that_matches_torch_mla(
        non_causal):
    """A graph step carried to lengths of a chunk structure neither the held plan nor the plan
    cache holds (request 1 grows from 2040 to 2300 tokens: 12 chunks of 192, not 11) takes a
    plan written on the host (flashinfer_host_plan.py), put back with its page lists rebuilt
    on the device: no native plan, and FlashInfer on the carried metadata equals TORCH_MLA on
    metadata built afresh. Verify rows (causal Q=5) and draft blocks (non-causal Q=5)."""
    import numpy as np
    nxt = [704, 2300, 64, 13]
    builder, md, run, ref, _ = _carried_step(non_causal, [700, 2040, 60, 9], nxt, 83, 84)
    slot = md.decode.backend_state.wrapper_slot
    refresher = slot.refresher
    held = refresher.skeleton
    plans = (slot.native_replans, slot.full_plans)
    assert not held.fits(held.qo_indptr, np.array(nxt + [0] * (held.qo_indptr.shape[0] - 5)))
    assert builder.advance_graph_step(md, np.array(nxt, dtype=np.int32))
    assert (slot.native_replans, slot.full_plans) == plans and slot.host_plans == 1
    assert refresher.skeleton is not held and refresher.cache_put_backs == 1
    assert_states_close(run(FlashInferMLAImpl, md.decode), ref)
