"""Refreshing a FlashInfer MLA plan for new lengths keeps it a valid plan, and only then.

The plans come from a model of FlashInfer's planner (tests/utils/flashinfer_mla_plan_model.py);
the checker reads the refreshed int workspace the way the kernels do and demands that every
request's chunks tile its new KV exactly with its old chunk count. The brute-force oracle of
`fits` re-cuts every request with a plain loop. The real planner and kernels are checked on the
GPU (tests/v1/attention/test_flashinfer_mla_gpu.py).
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.utils.flashinfer_mla_plan_model import assert_valid_plan, model_plan, plan_works
from vllm.v1.attention.backends.mla.flashinfer_plan_refresh import (DEFAULT_SLACK_TOKENS,
                                                                     REFRESH_SLACK_TOKENS,
                                                                     SLACK_FLAG, PlanRefresher,
                                                                     DRAFT_SLACK_FLAG,
                                                                     DEFAULT_DRAFT_SLACK_TOKENS,
                                                                     PlanSkeleton, kv_len_limit,
                                                                     refresh_slack)


@pytest.fixture(params=[None, str(REFRESH_SLACK_TOKENS)], ids=["default-slack", "slack-128"])
def slack_env(request, monkeypatch):
    """Every refresh test with the default slack and with VLLM_MLA_REFRESH_SLACK_TOKENS=128."""
    if request.param is None:
        monkeypatch.delenv(SLACK_FLAG, raising=False)
    else:
        monkeypatch.setenv(SLACK_FLAG, request.param)
    return request.param


def _pages(kv, page=16):
    return np.concatenate([[0], np.cumsum(-(-np.asarray(kv) // page))]).astype(np.int32)


def _batch(rng, num_real, num_pad, q, max_kv):
    kv = [rng.randint(0, max_kv) for _ in range(num_real)] + [0] * num_pad
    qo = np.concatenate([[0], np.cumsum([q] * num_real + [0] * num_pad)]).astype(np.int32)
    return qo, np.asarray(kv, dtype=np.int32)


def _chunks_by_loop(kv, limit):
    """Brute force: cut [0, kv) the way the planner does, one chunk at a time."""
    if kv <= limit:
        return 1
    n, left = 0, kv
    while left > 0:
        left -= min(left, limit)
        n += 1
    return n


@pytest.mark.parametrize("seed", range(40))
def test_refreshed_plans_stay_valid_and_fits_agrees_with_brute_force(seed, slack_env):
    rng = random.Random(seed)
    heads = rng.choice([4, 16, 128])
    q = rng.choice([1, 1, 2, 4]) if heads <= 16 else 1
    num_sm = rng.choice([8, 16, 132])
    qo, kv = _batch(rng, rng.randint(1, 12), rng.randint(0, 3), q, rng.choice([40, 700, 5000]))
    info, scratch, limit = model_plan(qo, kv, _pages(kv), heads, num_sm)
    cluster_size = info[0]
    assert kv_len_limit(qo, kv, heads, cluster_size, info[1]) == limit
    sk = PlanSkeleton.from_plan(info, scratch, qo, kv, heads, causal=False)
    if q * heads > 64 * cluster_size:
        assert sk is None  # several query tiles per request: never refreshed
        return
    assert sk is not None
    old_counts = {i: _chunks_by_loop(int(k), limit) for i, k in enumerate(kv) if qo[i + 1] > qo[i]}
    slack = refresh_slack(limit)
    bound = DEFAULT_SLACK_TOKENS if slack_env is None else int(slack_env)
    assert slack == min(limit, bound)
    for trial in range(8):
        new = kv.copy()
        n = int((qo[1:] > qo[:-1]).sum())
        for i in range(n):
            new[i] += rng.choice([0, 1, 1, 2, 7, limit // 2, limit, limit + slack])
        # Brute force: the old chunks, cut at the limit, with the last one stretched to the
        # new length, must stay chunks (none emptied) with the last within limit + slack.
        same = all(_chunks_by_loop(int(kv[i]), limit) == old_counts[i]
                   and int(new[i]) - (old_counts[i] - 1) * limit <= limit + slack
                   and (old_counts[i] == 1 or int(new[i]) > (old_counts[i] - 1) * limit)
                   for i in range(n))
        assert sk.fits(qo, new) == same, (kv, new, limit)
        if not same:
            continue
        ws = scratch.clone().view(torch.int32).numpy()  # the "device" int workspace
        out = np.zeros((3, sk.num_works), dtype=np.int32)
        ptr = _pages(new)
        sk.fill(out, ptr, new)
        for row, f in enumerate(("kv_indptr", "kv_len", "kv_end")):
            ws[sk.offsets[f]: sk.offsets[f] + sk.num_works] = out[row]
        assert_valid_plan(plan_works(ws, info), qo, new, ptr, limit, old_counts,
                          last_chunk_limit=limit + slack)


def test_fits_refuses_other_query_rows_and_nonzero_padding():
    qo, kv = np.array([0, 1, 2, 2], dtype=np.int32), np.array([300, 40, 0], dtype=np.int32)
    info, scratch, _ = model_plan(qo, kv, _pages(kv), 16, 8)
    sk = PlanSkeleton.from_plan(info, scratch, qo, kv, 16, causal=False)
    assert sk is not None and sk.fits(qo, kv + np.array([1, 1, 0], dtype=np.int32))
    assert not sk.fits(np.array([0, 1, 2, 3], dtype=np.int32), kv)  # a padding row became real
    assert not sk.fits(qo, np.array([301, 41, 5], dtype=np.int32))
    assert not sk.fits(qo, np.array([0, 41, 0], dtype=np.int32))  # fewer chunks: re-plan


def test_unrecognised_plans_give_no_skeleton():
    qo, kv = np.array([0, 1, 2], dtype=np.int32), np.array([900, 60], dtype=np.int32)
    info, scratch, _ = model_plan(qo, kv, _pages(kv), 16, 8)
    assert PlanSkeleton.from_plan(info[:-1], scratch, qo, kv, 16, causal=False) is None
    # a plan that does not cover a request (a work lost) is not adopted
    broken = scratch.clone()
    ws = broken.view(torch.int32).numpy()
    end_at = info[2 + 12] // 4  # kv_end
    ws[end_at] -= 1
    assert PlanSkeleton.from_plan(info, broken, qo, kv, 16, causal=False) is None
    # lengths that are not the ones planned
    assert PlanSkeleton.from_plan(info, scratch, qo, kv + 1, 16, causal=False) is None


def test_refresher_writes_the_work_arrays_through_its_ring(slack_env):
    qo, kv = np.array([0, 1, 2, 3, 3], dtype=np.int32), np.array([700, 33, 0, 0], dtype=np.int32)
    info, scratch, limit = model_plan(qo, kv, _pages(kv), 16, 8)
    device_ws = scratch.clone()  # CPU stand-in for the device int workspace
    refresher = PlanRefresher(device_ws, max_works=64)
    refresher.adopt(PlanSkeleton.from_plan(info, scratch, qo, kv, 16, causal=False))
    counts = {0: _chunks_by_loop(700, limit), 1: 1, 2: 1}
    for step in range(1, 6):
        new = kv + np.array([step, step, step, 0], dtype=np.int32)
        assert refresher.try_refresh(qo, _pages(new), new)
        assert_valid_plan(plan_works(device_ws.view(torch.int32).numpy(), info), qo, new,
                          _pages(new), limit, counts,
                          last_chunk_limit=limit + refresh_slack(limit))
    assert refresher.refreshes == 5
    # request 0's last chunk past limit + slack: its chunk count must change, a real plan
    grown = kv + np.array([limit + refresh_slack(limit), 0, 0, 0])
    assert not refresher.try_refresh(qo, _pages(grown), grown)
    refresher.adopt(None)
    assert not refresher.try_refresh(qo, _pages(kv), kv)


def _graph_slot(monkeypatch, R, max_pages, heads=16, num_sm=8):
    """A graph wrapper slot on a stand-in backend whose native planner is the planner model
    (the plan lands in a pinned scratch and, as FlashInfer's staged copy does, the "device" int
    workspace); returns (slot, backend, device workspace, chunk limits of the real plans)."""
    import sys
    from types import ModuleType

    from vllm.v1.attention.backends.mla import flashinfer_mla as fm
    fa_common = ModuleType("_fa_common")
    fa_common._validate_fa_plan_workload = lambda *a: None
    for name in ["flashinfer", "flashinfer.mla", "flashinfer.mla._batch_mla",
                 "flashinfer.mla._batch_mla._backends"]:
        monkeypatch.setitem(sys.modules, name, ModuleType(name))
    monkeypatch.setitem(sys.modules, "flashinfer.mla._batch_mla._backends._fa_common", fa_common)
    device_ws = torch.zeros(1 << 20, dtype=torch.uint8)
    pinned = torch.zeros(1 << 20, dtype=torch.uint8)
    limits = []

    def native(fws, iws, pws, qo, kv_indptr, kv_len, h, ckv, causal):
        info, scratch, limit = model_plan(qo.numpy(), kv_len.numpy(), kv_indptr.numpy(), h,
                                          num_sm)
        pws[: scratch.numel()] = scratch
        iws[: scratch.numel()] = scratch  # FlashInfer's staged copy to the device
        limits.append(limit)
        return info, scratch.numel()

    flat = torch.zeros(fm.packed_csr_size(R, max_pages), dtype=torch.int32)
    bufs = fm.packed_csr_views(flat, R)
    backend = SimpleNamespace(
        _cached_module=SimpleNamespace(plan_with_staged_workspace_bytes=native),
        _backend="fa3", _causal=False, _use_cuda_graph=True, device=torch.device("cpu"),
        _qo_indptr_buf=bufs[0], _kv_indptr_buf=bufs[1], _kv_len_arr_buf=bufs[2],
        _kv_indices_buf=bufs[3], _float_workspace_buffer=None, _int_workspace_buffer=device_ws,
        _pin_memory_int_workspace_buffer=pinned, _plan_info=None)

    class Wrapper:
        _planned_backend = backend

        def __setattr__(self, name, value):
            object.__setattr__(self, name, value)
            if name == "_plan_info":
                backend._plan_info = value

    plan_args = dict(num_heads=heads, head_dim_ckv=512, kv_data_type=torch.bfloat16)
    slot = fm._WrapperSlot(Wrapper(), plan_args=plan_args, packed_device=flat,
                           packed_layout=(R, max_pages),
                           staging=fm.PlanStaging(R, max_pages, depth=2))
    return slot, backend, device_ws, limits


def test_graph_plans_refresh_between_real_plans(monkeypatch):
    """Through `_plan`: steady decode on a graph wrapper takes refreshes, and a real (native)
    plan whenever a request changes its chunk count or the rows change; after every step the
    wrapper's int workspace is a valid plan for that step's lengths."""
    from vllm.v1.attention.backends.mla import flashinfer_mla as fm
    R, page = 4, 16
    slot, backend, device_ws, limits = _graph_slot(monkeypatch, R, 64)
    plan_args, bufs = slot.plan_args, fm.packed_csr_views(slot.packed_device, R)
    seq = [150, 31, 64, 0]
    real = 3
    native_before = 0
    for step in range(80):
        if step == 50:
            real = 4  # a request joins: new rows, a real plan
            seq[3] = 5
        qo = np.concatenate([[0], np.cumsum([1] * real + [0] * (R - real))]).astype(np.int32)
        kv = np.asarray(seq, dtype=np.int32)
        qo_t, ptr_t, kvl_t, idx_t = (torch.from_numpy(a) for a in (
            qo, _pages(kv, page), kv, np.arange(int(_pages(kv, page)[-1]), dtype=np.int32)))
        inputs = fm.HopperPlanInputs(qo_indptr=qo_t, kv_indptr=ptr_t, kv_indices=idx_t,
                                     kv_len_arr=kvl_t, causal=False)
        fm._plan(slot, inputs, ("step", step), **plan_args)
        ws = device_ws.view(torch.int32).numpy()
        assert_valid_plan(plan_works(ws, backend._plan_info), qo, kv, _pages(kv, page),
                          limits[-1], last_chunk_limit=limits[-1] + refresh_slack(limits[-1]))
        assert torch.equal(bufs[3][: idx_t.numel()], idx_t)  # the CSR still moves every step
        if step == 50:
            assert slot.native_replans > native_before  # new rows: planned for real
        native_before = slot.native_replans
        for i in range(real):
            seq[i] += 1
    assert slot.refreshes >= 60, (slot.refreshes, slot.native_replans, slot.full_plans)
    assert slot.native_replans >= 2  # the first plan, and the joining request


@pytest.mark.parametrize("seed", range(4))
def test_staged_steady_decode_refreshes_through_the_staging_ring(monkeypatch, seed):
    """The builder's own sequence (plan_hopper_decode into the slot's staging ring, then
    `_plan`) over steady Q=1 decode with rows joining, chunk-count jumps, rewritten block table
    rows and DCP-local lengths: after every step the int workspace is a valid plan for the
    step's lengths and the device CSR equals a brute-force one; refreshes use the staging
    ring's buffers (no event of their own)."""
    from vllm.v1.attention.backends.mla import flashinfer_mla as fm
    from vllm.v1.attention.backends.mla.common import MLACommonDecodeMetadata
    rng = random.Random(seed)
    R, page, max_blocks = 6, 16, 64
    slot, backend, device_ws, limits = _graph_slot(monkeypatch, R, R * max_blocks)
    table = [[rng.randrange(5000) for _ in range(max_blocks)] for _ in range(R)]
    dcp = rng.choice([1, 2])
    lens = [rng.randint(1, 400) for _ in range(R)]
    live = rng.randint(1, R)
    for step in range(70):
        event = rng.random()
        if event < 0.05:
            live = max(1, min(R, live + rng.choice([-1, 1])))  # rows change
        elif event < 0.1:
            lens[rng.randrange(live)] += rng.choice([100, 300])  # chunk count jumps
        elif event < 0.15:
            table[rng.randrange(live)] = [rng.randrange(5000) for _ in range(max_blocks)]
        q_lens = [1] * live + [0] * (R - live)
        qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        row_lens = lens[:live] + [0] * (R - live)  # rank-local visible lengths (DCP or not)
        bt = torch.tensor(table, dtype=torch.int32)
        decode = MLACommonDecodeMetadata(
            block_table=bt, seq_lens=torch.tensor(row_lens, dtype=torch.int32),
            dcp_tot_seq_lens=None, query_start_loc=torch.from_numpy(qsl), max_query_len=1,
            max_seq_len=max(row_lens), causal=True, query_start_loc_cpu=torch.from_numpy(qsl),
            num_decode_tokens=R, row_seq_lens=torch.tensor(row_lens, dtype=torch.int32),
            dcp_world_size=dcp, row_seq_lens_cpu=torch.tensor(row_lens, dtype=torch.int32),
            block_table_cpu=bt, cudagraph=True)
        inputs = fm.plan_hopper_decode(decode, page, "auto", num_requests=R,
                                       staging=slot.staging)
        fm._plan(slot, inputs, ("step", step), **slot.plan_args)
        qo = [0]
        kv_lens, indices = [], []
        for i in range(R):
            qo.append(qo[-1] + q_lens[i])
            kv_lens.append(row_lens[i] if q_lens[i] else 0)
            if q_lens[i]:
                indices.extend(table[i][: -(-row_lens[i] // page)])
        ptr = _pages(kv_lens, page)
        ws = device_ws.view(torch.int32).numpy()
        assert_valid_plan(plan_works(ws, backend._plan_info), np.asarray(qo), kv_lens, ptr,
                          limits[-1], last_chunk_limit=limits[-1] + refresh_slack(limits[-1]))
        bufs = fm.packed_csr_views(slot.packed_device, R)
        assert bufs[0].tolist() == qo and bufs[1].tolist() == ptr.tolist()
        assert bufs[2].tolist() == kv_lens
        assert bufs[3][: len(indices)].tolist() == indices
        for i in range(live):
            lens[i] += 1
    refresher = slot.refresher
    assert slot.refreshes >= 30, (slot.refreshes, slot.native_replans)
    assert refresher._ring_host and refresher._next == 0  # the staging ring's buffers only


def test_single_tile_causal_plans_are_cut_as_non_causal_ones_and_refresh():
    """MLAPlan gives a request's last query tile its whole KV (packed_causal_kv_end), so when
    every request is one tile a causal plan equals the non-causal one and refreshes the same
    way (DSpark/EAGLE verify rows: Q = 1 + k, 16 heads)."""
    for q in (4, 5, 8):  # 64, 80, 128 packed rows: one tile of 64 or of 2 x 64 (cluster of 2)
        qo = np.arange(0, 4 * q + 1, q, dtype=np.int32)
        kv = np.array([700, 2049, 64, 300], dtype=np.int32)
        causal_info, causal_ws, limit = model_plan(qo, kv, _pages(kv), 16, 8, causal=True)
        plain_info, plain_ws, _ = model_plan(qo, kv, _pages(kv), 16, 8, causal=False)
        assert causal_info == plain_info and torch.equal(causal_ws, plain_ws)
        sk = PlanSkeleton.from_plan(causal_info, causal_ws, qo, kv, 16, causal=True)
        assert sk is not None, q
        new = kv + 1
        assert sk.fits(qo, new)
        ws = causal_ws.clone().view(torch.int32).numpy()
        out = np.zeros((3, sk.num_works), dtype=np.int32)
        ptr = _pages(new)
        sk.fill(out, ptr, new)
        for row, field in enumerate(("kv_indptr", "kv_len", "kv_end")):
            ws[sk.offsets[field]: sk.offsets[field] + sk.num_works] = out[row]
        old_counts = {i: _chunks_by_loop(int(k), limit) for i, k in enumerate(kv)}
        assert_valid_plan(plan_works(ws, causal_info), qo, new, ptr, limit, old_counts)
        # and what a fresh causal plan for the new lengths reads back as, work for work
        fresh_info, fresh_ws, _ = model_plan(qo, new, ptr, 16, 8, causal=True)
        if fresh_info == causal_info:
            assert plan_works(ws, causal_info) == plan_works(fresh_ws.view(torch.int32).numpy(),
                                                            fresh_info)


def test_multi_tile_causal_plans_give_no_skeleton():
    """Q = 9 rows x 16 heads = 144 packed rows: two tiles of 128; the first tile's KV ends at
    its last row (not the request's end), which a refresh would not move."""
    q = 9
    qo = np.arange(0, 2 * q + 1, q, dtype=np.int32)
    kv = np.array([900, 400], dtype=np.int32)
    info, scratch, _ = model_plan(qo, kv, _pages(kv), 16, 8, causal=True)
    assert PlanSkeleton.from_plan(info, scratch, qo, kv, 16, causal=True) is None


@pytest.mark.parametrize("stagger", [1, 5])
def test_drifted_requests_replan_about_as_rarely_as_lock_step_ones(monkeypatch, stagger):
    """Eight requests decoding one token per step: in lock-step (equal lengths) all cross a
    chunk edge in the same step; drifted (request i `stagger` x i tokens longer, as uneven
    acceptance leaves them) each crosses in its own step. Without refresh slack the drifted
    batch re-planned once per request per chunk edge (8x lock-step); with it, at most once
    per `slack` tokens of growth (VLLM_MLA_REFRESH_SLACK_TOKENS=128 here; off by default).
    Every step's workspace stays a valid plan."""
    from vllm.v1.attention.backends.mla import flashinfer_mla as fm
    monkeypatch.setenv(SLACK_FLAG, str(REFRESH_SLACK_TOKENS))
    R, page, steps = 8, 16, 400

    def run(lengths):
        slot, backend, device_ws, limits = _graph_slot(monkeypatch, R, R * 40)
        seq = list(lengths)
        qo = np.arange(R + 1, dtype=np.int32)
        for step in range(steps):
            kv = np.asarray(seq, dtype=np.int32)
            ptr = _pages(kv, page)
            inputs = fm.HopperPlanInputs(
                qo_indptr=torch.from_numpy(qo), kv_indptr=torch.from_numpy(ptr),
                kv_indices=torch.arange(int(ptr[-1]), dtype=torch.int32),
                kv_len_arr=torch.from_numpy(kv), causal=False)
            fm._plan(slot, inputs, ("step", step), **slot.plan_args)
            held = limits[-1]
            assert_valid_plan(plan_works(device_ws.view(torch.int32).numpy(), backend._plan_info),
                              qo, kv, ptr, held, last_chunk_limit=held + refresh_slack(held))
            seq = [g + 1 for g in seq]
        return slot.native_replans + slot.full_plans, limits

    lock_step, _ = run([100] * R)
    drifted, limits = run([100 + stagger * i for i in range(R)])
    smallest_slack = min(refresh_slack(limit) for limit in limits)
    assert drifted <= steps // smallest_slack + 2, (drifted, limits)
    assert drifted <= lock_step + 2, (drifted, lock_step)


def test_the_slack_bound_flag(monkeypatch):
    monkeypatch.delenv(SLACK_FLAG, raising=False)
    assert refresh_slack(64) == min(64, DEFAULT_SLACK_TOKENS) == 0  # off by default
    monkeypatch.setenv(SLACK_FLAG, str(REFRESH_SLACK_TOKENS))
    assert refresh_slack(64) == 64 and refresh_slack(1024) == REFRESH_SLACK_TOKENS
    monkeypatch.setenv(SLACK_FLAG, "0")
    assert refresh_slack(64) == 0
    qo, kv = np.array([0, 1], dtype=np.int32), np.array([300], dtype=np.int32)
    info, scratch, limit = model_plan(qo, kv, _pages(kv), 16, 8)
    sk = PlanSkeleton.from_plan(info, scratch, qo, kv, 16, causal=False)
    edge = -(-300 // limit) * limit  # the last chunk's edge at the planned limit
    assert sk.fits(qo, np.array([edge], dtype=np.int32))
    assert not sk.fits(qo, np.array([edge + 1], dtype=np.int32))  # no slack: a new chunk
    monkeypatch.setenv(SLACK_FLAG, "-3")
    with pytest.raises(ValueError, match=f"{SLACK_FLAG}='-3' is invalid"):
        refresh_slack(64)


def test_draft_plans_take_their_own_slack_flag(monkeypatch):
    """Draft-block plans (draft=True) take VLLM_MLA_DRAFT_REFRESH_SLACK_TOKENS (default 128),
    decode plans VLLM_MLA_REFRESH_SLACK_TOKENS (default 0); neither flag moves the other."""
    monkeypatch.delenv(SLACK_FLAG, raising=False)
    monkeypatch.delenv(DRAFT_SLACK_FLAG, raising=False)
    assert DEFAULT_DRAFT_SLACK_TOKENS == REFRESH_SLACK_TOKENS
    assert refresh_slack(1024, draft=True) == REFRESH_SLACK_TOKENS
    assert refresh_slack(64, draft=True) == 64 and refresh_slack(1024) == 0
    monkeypatch.setenv(SLACK_FLAG, "7")
    assert refresh_slack(1024, draft=True) == REFRESH_SLACK_TOKENS and refresh_slack(1024) == 7
    monkeypatch.setenv(DRAFT_SLACK_FLAG, "0")
    assert refresh_slack(1024, draft=True) == 0 and refresh_slack(1024) == 7
    monkeypatch.delenv(SLACK_FLAG)
    monkeypatch.delenv(DRAFT_SLACK_FLAG)
    qo, kv = np.array([0, 1], dtype=np.int32), np.array([300], dtype=np.int32)
    info, scratch, limit = model_plan(qo, kv, _pages(kv), 16, 8)
    edge = -(-300 // limit) * limit  # the last chunk's edge at the planned limit
    decode = PlanSkeleton.from_plan(info, scratch, qo, kv, 16, causal=False)
    draft = PlanSkeleton.from_plan(info, scratch, qo, kv, 16, causal=False, draft=True)
    grown = np.array([edge + min(limit, REFRESH_SLACK_TOKENS)], dtype=np.int32)
    assert not decode.fits(qo, grown) and draft.fits(qo, grown)
    assert not draft.fits(qo, grown + 1)
    monkeypatch.setenv(DRAFT_SLACK_FLAG, "x")
    with pytest.raises(ValueError, match=f"{DRAFT_SLACK_FLAG}='x' is invalid"):
        refresh_slack(64, draft=True)


@pytest.mark.parametrize("draft", [False, True])
def test_a_draft_wrapper_refreshes_past_the_chunk_edge_a_decode_wrapper_replans_at(
        monkeypatch, draft):
    """Through the builder's _plan: a request grown past its last chunk's edge (within the
    draft slack) is refreshed on a draft-block wrapper and planned anew on a decode wrapper."""
    from vllm.v1.attention.backends.mla import flashinfer_mla as fm
    monkeypatch.delenv(SLACK_FLAG, raising=False)
    monkeypatch.delenv(DRAFT_SLACK_FLAG, raising=False)
    R = 2
    slot, backend, device_ws, limits = _graph_slot(monkeypatch, R, R * 60)
    slot.draft = draft
    qo = np.arange(R + 1, dtype=np.int32) * 5
    kv_first = np.array([300, 420], dtype=np.int32)

    def plan(kv, key):
        ptr = _pages(kv)
        inputs = fm.HopperPlanInputs(
            qo_indptr=torch.from_numpy(qo), kv_indptr=torch.from_numpy(ptr),
            kv_indices=torch.arange(int(ptr[-1]), dtype=torch.int32),
            kv_len_arr=torch.from_numpy(kv), causal=False)
        fm._plan(slot, inputs, key, **slot.plan_args)
        assert_valid_plan(plan_works(device_ws.view(torch.int32).numpy(), backend._plan_info),
                          qo, kv, ptr, limits[-1],
                          last_chunk_limit=limits[-1] + refresh_slack(limits[-1], draft))
        return slot.native_replans + slot.full_plans

    first = plan(kv_first, "a")
    limit = limits[-1]
    edge = -(-300 // limit) * limit
    grown = kv_first.copy()
    grown[0] = edge + 1  # one token into a new chunk at the planned limit
    after = plan(grown, "b")
    assert after == first + (0 if draft else 1), (draft, first, after, limit)


@pytest.mark.parametrize("seed", range(30))
def test_lowering_on_the_device_writes_what_a_host_refresh_writes(seed):
    """The early draft step's device lowering (PlanRefresher.lower_on_device) against the host
    refresh for the same exact lengths: a plan made for upper-bound lengths (every draft
    accepted, the CSR listing their pages), lowered to lengths in [upper - k, upper], leaves the
    int workspace byte for byte as try_refresh leaves it, on random single- and multi-chunk
    plans (one query tile per request: the refreshable kind)."""
    rng = random.Random(seed)
    k = rng.choice([1, 3, 4, 7])
    num_real, num_pad = rng.randint(1, 10), rng.randint(0, 3)
    q = k + 1
    qo = np.concatenate([[0], np.cumsum([q] * num_real + [0] * num_pad)]).astype(np.int32)
    upper = np.array([rng.randint(k + 2, rng.choice([60, 700, 3000])) for _ in range(num_real)]
                     + [0] * num_pad, dtype=np.int32)
    pages = _pages(upper)  # the CSR of the upper bound (its pages stay listed)
    heads = 16 if q * 16 <= 64 else 8  # every request one query tile (64 rows x heads)
    info, scratch, limit = model_plan(qo, upper, pages, heads, rng.choice([8, 132]))
    skeleton = PlanSkeleton.from_plan(info, scratch, qo, upper, heads, causal=False)
    assert skeleton is not None
    lower = upper.copy()
    lower[:num_real] -= k
    exact = upper.copy()
    exact[:num_real] -= np.array([rng.randint(0, k) for _ in range(num_real)], dtype=np.int32)
    host_ws, device_ws = scratch.clone(), scratch.clone()
    on_host, on_device = PlanRefresher(host_ws, max_works=256), PlanRefresher(device_ws, 256)
    on_host.adopt(skeleton)
    on_device.adopt(skeleton)
    if not skeleton.fits(qo, lower):
        return  # a last chunk would empty: the early path refreshes on the host instead
    assert on_host.try_refresh(qo, pages, exact)
    on_device.lower_on_device(torch.from_numpy(exact[:num_real]))
    assert torch.equal(device_ws, host_ws)
    assert on_device.device_lowerings == 1
    assert_valid_plan(plan_works(device_ws.view(torch.int32).numpy(), info), qo, exact, pages,
                      limit, last_chunk_limit=limit + refresh_slack(limit))
