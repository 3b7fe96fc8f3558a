"""FlashInfer MLA plans written on the host (flashinfer_host_plan.py) on the CPU.

Oracles: the heap's pops are checked by brute force (a least-cost cluster every time) and its
tie order against libstdc++'s algorithms worked by hand; the plan's cut, partial slots and
merge entries against the plan model (tests/utils/flashinfer_mla_plan_model.py, MLAPlan
modelled independently, with stand-in cluster costs); the skeleton against
PlanSkeleton.from_plan's read-back of the same plan. Through the builder: a structure the plan
cache lacks takes a host plan instead of the planner, cut as a fresh plan would be. The GPU
tests (test_flashinfer_mla_gpu.py) compare the plans with FlashInfer's planner byte for byte
and the attention on them with TORCH_MLA."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.utils.call_probes import check_switch
from tests.utils.flashinfer_mla_plan_model import (FIELDS, MERGE_FIELDS, assert_valid_plan,
                                                   model_plan, plan_works)
from tests.utils.held_flashinfer_plan import (UPPER, expect_plan_for, held_plan,
                                              page_lists)
from vllm.v1.attention.backends.mla.flashinfer_host_plan import (HOST_PLANS_FLAG,
                                                                 _StdMinHeap,
                                                                 host_plans_enabled,
                                                                 mla_plan, skeleton_of,
                                                                 workspace_values)
from vllm.v1.attention.backends.mla.flashinfer_plan_cache import plan_regions
from vllm.v1.attention.backends.mla.flashinfer_plan_refresh import PlanSkeleton

NUM_SM = 132


def test_ties_pop_in_libstdcxx_order():
    """Four clusters at cost 0, each popped one gets a chunk (its cost grows): libstdc++'s
    pop_heap moves the last element into the root's hole after sifting the hole down along
    the right child on ties, so the pops go 0, 2, 3, 1 (worked by hand from stl_heap.h's
    __adjust_heap and __push_heap; FlashInfer's MinHeap starts from clusters 0..3 in order).
    Python's heapq would give 0, 1, 2, 3."""
    heap = _StdMinHeap(4)
    order = []
    for _ in range(4):
        cluster, cost = heap.pop()
        order.append(cluster)
        heap.push(cluster, cost + 133)
    assert order == [0, 2, 3, 1]


@pytest.mark.parametrize("seed", range(4))
def test_every_pop_is_a_least_cost_cluster(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.choice([1, 2, 5, 66, 132]))
    heap = _StdMinHeap(n)
    costs = [0] * n
    for _ in range(500):
        cluster, cost = heap.pop()
        assert cost == costs[cluster] == min(costs)
        costs[cluster] += int(rng.choice([128, 256 + int(rng.integers(0, 900))]))
        heap.push(cluster, costs[cluster])
        assert sorted(heap.index) == list(range(n))


def _batch(rng, heads: int):
    batch = int(rng.integers(1, 24))
    q_lens = rng.integers(0, 13, batch)
    q_lens[rng.random(batch) < 0.2] = 0
    kv = rng.integers(0, 5000, batch) * (q_lens > 0)
    qo = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(-(-kv // 16))]).astype(np.int32)
    return qo, indptr, kv.astype(np.int32)


def _model_merges(scratch: torch.Tensor, info) -> list[tuple]:
    ws = scratch.view(torch.int32).numpy()
    at = dict(zip(FIELDS, info[2:16]))
    columns = [ws[at[f] // 4: at[f] // 4 + NUM_SM].tolist() for f in MERGE_FIELDS]
    return [m for m in zip(*columns) if m[0] != m[1]]


def _by_chunk(works) -> list[tuple]:
    keys = ("q_indptr", "q_start", "kv_start", "kv_end", "kv_len", "q_len", "kv_indptr",
            "partial_indptr")
    return sorted(tuple(w[k] for k in keys) for w in works)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_the_plan_cuts_and_merges_as_the_plan_model(seed, causal):
    """Random batches (padding requests, one to several query tiles, split and unsplit KV):
    the same clusters, limit, chunks, partial slots and merge entries as the model's fresh
    plan (only which cluster computes a chunk may differ: the model's costs are stand-ins);
    written at plan_regions' positions, the kernels' read-back finds exactly these works."""
    rng = np.random.default_rng(100 * seed + causal)
    for _ in range(20):
        heads = int(rng.choice([16, 64, 128]))
        qo, indptr, kv = _batch(rng, heads)
        plan = mla_plan(qo, indptr, kv, heads, NUM_SM, causal)
        info, scratch, limit = model_plan(qo, kv, indptr, heads, num_sm=NUM_SM, causal=causal)
        assert (plan.cluster_size, plan.num_clusters, plan.limit) == (info[0], info[1], limit)
        assert plan.merges == _model_merges(scratch, info)
        model_works = plan_works(scratch.view(torch.int32).numpy(), info)
        ws = np.full(info[-2] // 4, -7, dtype=np.int32)  # garbage outside the regions
        positions = plan_regions(info, plan.work_indptr[-1])
        ws[positions] = workspace_values(plan, info)
        works = plan_works(ws, info)
        assert _by_chunk(works) == _by_chunk(model_works)
        # the works in cluster order, each cluster's list as dealt
        assert [w["kv_end"] for w in works] == plan.works["kv_end"]
        at = dict(zip(FIELDS, info[2:16]))
        assert ws[at["work_indptr"] // 4: at["work_indptr"] // 4 + info[1] + 1].tolist() == \
            plan.work_indptr
        if all(q * heads <= 64 * plan.cluster_size for q in np.diff(qo)):  # one tile each
            assert_valid_plan(works, qo, kv, indptr, chunk_limit=limit)


@pytest.mark.parametrize("draft", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_the_skeleton_is_the_read_back_of_the_same_plan(causal, draft):
    """skeleton_of(plan) equals PlanSkeleton.from_plan reading that plan from a scratch
    (single-tile requests, then padding requests with no rows, as plan_hopper_decode lays
    them out); requests over several query tiles have no skeleton either way."""
    rng = np.random.default_rng(11 + 2 * causal + draft)
    heads = 16
    for trial in range(30):
        real = int(rng.integers(1, 9))
        q = int(rng.integers(1, 5))  # 4 rows of 16 heads: one 64-row tile
        lengths = rng.integers(1, 4000, real)
        if trial % 4 == 0:
            lengths[0] = 0  # an empty KV: one empty work
        qo = np.array([0] + [q * (i + 1) for i in range(real)] + [q * real] * 3, dtype=np.int32)
        kv = np.concatenate([lengths, [0] * 3]).astype(np.int32)
        indptr = np.concatenate([[0], np.cumsum(-(-kv // 16))]).astype(np.int32)
        plan = mla_plan(qo, indptr, kv, heads, NUM_SM, causal)
        info = model_plan(qo, kv, indptr, heads, num_sm=NUM_SM, causal=causal)[0]
        scratch = torch.full((info[-2],), 0x5A, dtype=torch.uint8)
        ws = scratch.view(torch.int32).numpy()
        ws[plan_regions(info, plan.work_indptr[-1])] = workspace_values(plan, info)
        want = PlanSkeleton.from_plan(info, scratch, qo, kv, heads, causal, draft=draft)
        got = skeleton_of(plan, qo, kv, heads, causal, info, draft=draft)
        assert (want is None) == (got is None) and want is not None
        for name in ("num_real", "num_works", "limit", "counts", "num_clusters", "info",
                     "ends_are_lengths", "qo_bytes", "offsets", "num_heads", "causal"):
            assert getattr(got, name) == getattr(want, name), name
        for name in ("qo_indptr", "lo", "hi", "work_req", "last_work", "last_req", "kv_end"):
            assert np.array_equal(getattr(got, name), getattr(want, name)), name
    qo = np.array([0, 9, 10], dtype=np.int32)  # 9 rows of 16 heads: two tiles of 128
    kv = np.array([500, 40], dtype=np.int32)
    plan = mla_plan(qo, np.array([0, 32, 35], dtype=np.int32), kv, heads, NUM_SM, causal)
    info = model_plan(qo, kv, np.array([0, 32, 35]), heads, num_sm=NUM_SM, causal=causal)[0]
    assert skeleton_of(plan, qo, kv, heads, causal, info) is None


def test_costs_past_float32s_exact_range_go_to_the_native_planner():
    """MLAPlan adds float32 costs; past 2**24 the sums round and a Python sum would not, so
    such a workload gets no host plan (None) rather than another plan."""
    qo = np.array([0, 1, 2], dtype=np.int32)
    indptr = np.array([0, 1, 2], dtype=np.int32)
    # (the guard bounds every cost added, 2 * 64 per chunk besides the KV: 132 chunks here)
    assert mla_plan(qo, indptr, np.array([9_000_000, 8_000_000]), 16, NUM_SM, False) is None
    assert mla_plan(qo, indptr, np.array([9_000_000, 7_000_000]), 16, NUM_SM, False) is not None


def test_the_switch(monkeypatch):
    check_switch(monkeypatch, HOST_PLANS_FLAG, host_plans_enabled, default=True)


# Through the builder (the plan-model stand-in of FlashInfer, tests/utils/fake_flashinfer.py):
# UPPER = [708, 2053, 70, 12] is planned (limit 192: 4, 11, 1, 1 chunks); THIRD is another
# structure, planned by no one (request 0 in 5 chunks, past a draft plan's slack too).
THIRD = [900, 2000, 70, 12]


def _advance(builder, md, lengths, causal: bool) -> bool:
    bounds = np.array(lengths, dtype=np.int64)
    if causal:
        return builder.advance_graph_step(md, bounds.astype(np.int32))
    return builder.advance_decode_plan_on_device(md, (bounds, bounds))


@pytest.mark.parametrize("causal", [False, True], ids=["draft-noncausal", "verify-causal"])
def test_an_advance_into_a_structure_never_planned_takes_a_host_plan(monkeypatch, causal):
    """The advance that the plan cache alone refuses (no kept plan of THIRD's structure) takes
    a plan written on the host: no planner call, no host build; the plan is kept, put back,
    its page lists rebuilt on the device and its lengths written, and it is cut as a fresh
    plan for THIRD would be. Back to UPPER's structure, the kept native plan serves."""
    builder, md, ws, _, _ = held_plan(monkeypatch, causal=causal)
    slot = md.decode.backend_state.wrapper_slot
    refresher = slot.refresher
    plans = (slot.native_replans, slot.full_plans)
    kept = len(refresher.cache)
    md.decode.seq_lens[:4] = torch.tensor(THIRD)
    assert _advance(builder, md, THIRD, causal)
    assert (slot.native_replans, slot.full_plans) == plans
    assert slot.host_plans == 1 and refresher.cache_put_backs == 1
    assert len(refresher.cache) == kept + 1 and refresher.page_list_rebuilds == 1
    backend = slot.wrapper._planned_backend
    indptr, indices = page_lists(md.decode.block_table, THIRD)
    assert backend._kv_indptr_buf[:5].tolist() == indptr
    assert backend._kv_indices_buf[:indptr[-1]].tolist() == indices
    assert backend._kv_len_arr_buf[:4].tolist() == THIRD
    expect_plan_for(md, ws, slot, THIRD, causal, indptr)
    md.decode.seq_lens[:4] = torch.tensor(UPPER)
    assert _advance(builder, md, UPPER, causal)
    assert slot.host_plans == 1 and refresher.cache_put_backs == 2
    expect_plan_for(md, ws, slot, UPPER, causal, page_lists(md.decode.block_table, UPPER)[0])


@pytest.mark.parametrize("causal", [False, True], ids=["draft-noncausal", "verify-causal"])
def test_a_build_for_a_structure_never_planned_takes_a_host_plan(monkeypatch, causal):
    """The host build path (a step that could not advance) gets a host plan the same way,
    refreshed for the host lengths and the CSR it built."""
    builder, _, ws, _, upper_cm = held_plan(monkeypatch, causal=causal)
    md = builder.build(0, replace(upper_cm, seq_lens_cpu=torch.tensor(THIRD, dtype=torch.int32)))
    slot = md.decode.backend_state.wrapper_slot
    assert slot.host_plans == 1 and slot.native_replans == 1  # (the held plan's own)
    csr = md.decode.backend_state.hopper_inputs.arrays[1]
    expect_plan_for(md, ws, slot, THIRD, causal, csr[:5].tolist())


def test_a_draft_range_takes_a_host_plan_that_serves_all_of_it(monkeypatch):
    """A draft block's bounds (every draft rejected .. all accepted) of a structure never
    planned: the host plan is written for the lower bound and serves up to the upper one
    within its last chunks' slack; the device's exact lengths are written into it."""
    builder, md, ws, _, _ = held_plan(monkeypatch, causal=False)
    slot = md.decode.backend_state.wrapper_slot
    lower = np.array(THIRD, dtype=np.int64)
    md.decode.seq_lens[:4] = torch.tensor(THIRD) + 2
    assert builder.advance_decode_plan_on_device(md, (lower, lower + 4))
    assert slot.host_plans == 1
    lengths = (lower + 2).tolist()
    expect_plan_for(md, ws, slot, lengths, False, page_lists(md.decode.block_table,
                                                             lengths)[0])


def test_a_verify_range_across_structures_is_refused_without_a_plan(monkeypatch):
    """Verify plans decide the output: lengths whose lower and upper bounds are of other
    structures get no plan (the lengths are not known yet), host-written or kept."""
    builder, md, ws, _, _ = held_plan(monkeypatch, causal=False)
    slot = md.decode.backend_state.wrapper_slot
    slot.draft = False  # a plan whose split decides the output
    refresher = slot.refresher
    lower = np.array(THIRD, dtype=np.int64)
    upper = lower.copy()
    upper[1] = 2200  # 12 chunks of 192 where the lower bound has 11
    before = ws.clone()
    assert refresher.find_kept(refresher.skeleton.qo_bytes, lower, upper, False) is None
    assert slot.host_plans == 0 and torch.equal(ws, before)


def test_other_query_rows_take_no_host_plan(monkeypatch):
    """A host plan is written for the held plan's query rows only: a step with other rows
    (a request joined) is planned by FlashInfer."""
    builder, md, _, _, upper_cm = held_plan(monkeypatch, causal=True)
    slot = md.decode.backend_state.wrapper_slot
    refresher = slot.refresher
    other_rows = refresher.skeleton.qo_indptr.astype(np.int32)
    other_rows[-1] += 1
    lengths = np.array(THIRD, dtype=np.int64)
    assert refresher.find_kept(other_rows.tobytes(), lengths, lengths, False) is None
    assert slot.host_plans == 0


def test_without_host_plans_the_native_planner_plans_the_structure(monkeypatch):
    monkeypatch.setenv(HOST_PLANS_FLAG, "0")
    builder, md, _, _, upper_cm = held_plan(monkeypatch, causal=True)
    slot = md.decode.backend_state.wrapper_slot
    md.decode.seq_lens[:4] = torch.tensor(THIRD)
    assert not _advance(builder, md, THIRD, True)
    replans = slot.native_replans
    builder.build(0, replace(upper_cm, seq_lens_cpu=torch.tensor(THIRD, dtype=torch.int32)))
    assert slot.native_replans == replans + 1 and slot.host_plans == 0
