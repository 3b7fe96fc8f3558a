"""The Hopper CSR plan built with numpy into pinned staging equals a brute-force construction.

The oracle below walks every block row by row in plain Python (the definition in DESIGN §5:
fused blocks are one request that sees the block's last visible count; causal blocks under DCP
split into runs of equal visible counts, or one request per row when flattened), and lists each
request's pages straight from the block table.
"""
from __future__ import annotations

import random

import pytest
import torch

from vllm.v1.attention.backends.mla.common import MLACommonDecodeMetadata
from vllm.v1.attention.backends.mla.flashinfer_mla import PlanStaging, plan_hopper_decode


def _brute_force(q_lens, row_lens, block_table, page, fused, flattened, pad_to):
    qo, kv_lens, indices, start = [0], [], [], 0
    for req, q in enumerate(q_lens):
        rows = row_lens[start:start + q]
        start += q
        if q == 0:
            continue
        if fused:
            segments = [(q, rows[-1])]
        else:
            segments = []
            for n in rows:
                if segments and segments[-1][1] == n and not flattened:
                    segments[-1] = (segments[-1][0] + 1, n)
                else:
                    segments.append((1, n))
        for num_rows, kv in segments:
            qo.append(qo[-1] + num_rows)
            kv_lens.append(kv)
            indices.extend(block_table[req][: -(-kv // page)])
    if pad_to is not None:
        while len(kv_lens) < pad_to:
            qo.append(qo[-1])
            kv_lens.append(0)
    kv_indptr = [0]
    for kv in kv_lens:
        kv_indptr.append(kv_indptr[-1] + -(-kv // page))
    return qo, kv_indptr, kv_lens, indices


def _metadata(q_lens, row_lens, block_table, causal, dcp):
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    bt = torch.tensor(block_table, dtype=torch.int32)
    return MLACommonDecodeMetadata(
        block_table=bt, seq_lens=torch.zeros(len(q_lens), dtype=torch.int32),
        dcp_tot_seq_lens=None, query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        max_query_len=max(q_lens), max_seq_len=max(row_lens) if row_lens else 0, causal=causal,
        query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32),
        num_decode_tokens=len(row_lens), row_seq_lens=torch.tensor(row_lens, dtype=torch.int32),
        dcp_world_size=dcp, row_seq_lens_cpu=torch.tensor(row_lens, dtype=torch.int32),
        block_table_cpu=bt)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("mode", ["non_causal", "single", "causal_dcp1", "runs", "flattened"])
@pytest.mark.parametrize("staged", [False, True])
def test_plan_equals_brute_force(seed, mode, staged):
    rng = random.Random(seed * 31 + len(mode))
    page = rng.choice([1, 16, 64])
    num_reqs = rng.randint(1, 9)
    q = 1 if mode == "single" else rng.randint(2, 6)
    q_lens = [q] * num_reqs
    if rng.random() < 0.3:  # CUDA-graph padding: trailing zero-length rows
        q_lens[-1] = 0
    max_blocks = 12
    block_table = [[rng.randrange(1000) for _ in range(max_blocks)] for _ in range(num_reqs)]
    row_lens = []
    for qn in q_lens:
        last = rng.randint(0, page * max_blocks // 2)
        if mode in ("runs", "flattened", "causal_dcp1"):  # non-decreasing visible counts
            rows = sorted(max(0, last - rng.randint(0, 3)) for _ in range(qn))
        else:
            rows = [last] * qn
        row_lens.extend(rows)
    causal = mode not in ("non_causal",)
    dcp = 2 if mode in ("runs", "flattened") else 1
    causal_mode = "flattened" if mode == "flattened" else ("runs" if mode == "runs" else "auto")
    pad_to = None
    planned = sum(1 for x in q_lens if x) * (q if mode in ("runs", "flattened") else 1)
    if rng.random() < 0.5:
        pad_to = planned + rng.randint(0, 3)
    decode = _metadata(q_lens, row_lens, block_table, causal, dcp)
    staging = PlanStaging(64, 64 * max_blocks, depth=2) if staged else None
    got = plan_hopper_decode(decode, page, causal_mode, num_requests=pad_to, staging=staging)
    fused = mode in ("non_causal", "single", "causal_dcp1")
    qo, kv_indptr, kv_lens, indices = _brute_force(q_lens, row_lens, block_table, page, fused,
                                                   mode == "flattened", pad_to)
    if not kv_lens and pad_to is None:
        assert got is None
        return
    assert got.qo_indptr.tolist() == qo
    assert got.kv_indptr.tolist() == kv_indptr
    assert got.kv_len_arr.tolist() == kv_lens
    assert got.kv_indices.tolist() == indices
    assert got.causal == (mode == "causal_dcp1")
    assert got.has_empty_rows == (not kv_lens or min(kv_lens) == 0)
    for t in (got.qo_indptr, got.kv_indptr, got.kv_len_arr, got.kv_indices):
        assert t.dtype == torch.int32


def test_staging_ring_hands_out_distinct_buffers_and_reuses_them_in_order():
    staging = PlanStaging(4, 8, depth=3)
    first = [staging.acquire()[0].data_ptr() for _ in range(3)]
    assert len(set(first)) == 3
    assert [staging.acquire()[0].data_ptr() for _ in range(3)] == first


def test_plans_larger_than_the_staging_fall_back_to_fresh_tensors():
    decode = _metadata([1, 1, 1], [5, 6, 7], [[1, 2], [3, 4], [5, 6]], True, 1)
    staging = PlanStaging(2, 8, depth=2)  # room for 2 requests only
    got = plan_hopper_decode(decode, 4, staging=staging)
    assert got.kv_len_arr.tolist() == [5, 6, 7]
    assert got.kv_indices.tolist() == [1, 2, 3, 4, 5, 6]


def _copy_count(fn) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ == "copy_":
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def test_native_graph_replan_moves_the_packed_csr_in_one_copy(monkeypatch):
    """A graph wrapper whose four metadata buffers are views of one buffer laid out like the
    staging set takes a re-plan in ONE copy; the buffers then hold exactly what four separate
    copies into separate buffers give, step after step, and FlashInfer's workload check and
    native planner see the same host arrays."""
    import sys
    from types import ModuleType, SimpleNamespace

    from vllm.v1.attention.backends.mla import flashinfer_mla as fm
    calls = []
    fa_common = ModuleType("_fa_common")
    fa_common._validate_fa_plan_workload = lambda *a: calls.append(("check", a[2], a[3]))
    names = ["flashinfer", "flashinfer.mla", "flashinfer.mla._batch_mla",
             "flashinfer.mla._batch_mla._backends"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, ModuleType(name))
    sys.modules["flashinfer.mla._batch_mla._backends"]._fa_common = fa_common
    monkeypatch.setitem(sys.modules, "flashinfer.mla._batch_mla._backends._fa_common", fa_common)

    R, max_blocks, page = 4, 6, 16
    max_pages = R * max_blocks
    plan_args = dict(num_heads=8, head_dim_ckv=512, kv_data_type=torch.bfloat16)

    def native(fws, iws, pws, qo, kv_indptr, kv_len, heads, ckv, causal):
        calls.append(("native", qo.tolist(), kv_indptr.tolist(), kv_len.tolist()))
        return ("info", len(calls)), 7

    def make_slot(packed: bool):
        if packed:
            flat = torch.full((fm.packed_csr_size(R, max_pages),), -5, dtype=torch.int32)
            bufs = fm.packed_csr_views(flat, R)
        else:
            flat = None
            bufs = (torch.full((R + 1,), -5, dtype=torch.int32),
                    torch.full((R + 1,), -5, dtype=torch.int32),
                    torch.full((R,), -5, dtype=torch.int32),
                    torch.full((max_pages,), -5, dtype=torch.int32))
        backend = SimpleNamespace(
            _cached_module=SimpleNamespace(plan_with_staged_workspace_bytes=native),
            _backend="fa3", _causal=False, _use_cuda_graph=True, device=torch.device("cpu"),
            _qo_indptr_buf=bufs[0], _kv_indptr_buf=bufs[1], _kv_len_arr_buf=bufs[2],
            _kv_indices_buf=bufs[3], _float_workspace_buffer=None, _int_workspace_buffer=None,
            _pin_memory_int_workspace_buffer=None)
        return fm._WrapperSlot(SimpleNamespace(_planned_backend=backend), plan_args=plan_args,
                               packed_device=flat,
                               packed_layout=(R, max_pages) if packed else None), bufs

    packed_slot, packed_bufs = make_slot(True)
    plain_slot, plain_bufs = make_slot(False)
    staging = PlanStaging(R, max_pages, depth=2)
    rng = random.Random(3)
    for step in range(5):
        q_lens = [1] * (R - step % 2) + [0] * (step % 2)  # graph padding on odd steps
        row_lens = [rng.randint(0, page * max_blocks) if q else 0 for q in q_lens]
        table = [[rng.randrange(1000) for _ in range(max_blocks)] for _ in range(R)]
        inputs = plan_hopper_decode(_metadata(q_lens, row_lens, table, True, 1), page,
                                    num_requests=R, staging=staging)
        assert inputs.packed is not None and inputs.packed_layout == (R, max_pages)
        calls.clear()
        assert _copy_count(lambda: fm._native_replan(packed_slot, inputs, plan_args)) == 1
        packed_calls = list(calls)
        calls.clear()
        assert _copy_count(lambda: fm._native_replan(plain_slot, inputs, plan_args)) == 4
        assert packed_calls[0] == calls[0] and packed_calls[1][1:] == calls[1][1:]
        n = inputs.kv_indices.shape[0]
        for got, want, source in zip(packed_bufs, plain_bufs, (
                inputs.qo_indptr, inputs.kv_indptr, inputs.kv_len_arr, inputs.kv_indices)):
            m = source.shape[0]
            assert torch.equal(got[:m], source) and torch.equal(want[:m], source)
        assert torch.equal(packed_bufs[3][:n], plain_bufs[3][:n])


def test_graph_plans_in_other_layouts_do_not_take_the_packed_copy():
    """A staging set of another layout, or an eager-sized plan, carries no packed prefix (or a
    different layout key), so _native_replan falls back to the per-buffer copies."""
    decode = _metadata([1, 1], [20, 40], [[1, 2, 3], [4, 5, 6]], True, 1)
    eager = plan_hopper_decode(decode, 16, staging=PlanStaging(8, 64, depth=2))
    assert eager.packed is None  # 2 requests planned in an 8-request set
    graph = plan_hopper_decode(decode, 16, num_requests=2, staging=PlanStaging(2, 64, depth=2))
    assert graph.packed_layout == (2, 64)
    want = torch.cat([graph.qo_indptr, graph.kv_indptr, graph.kv_len_arr, graph.kv_indices])
    assert torch.equal(graph.packed, want)


@pytest.mark.parametrize("seed", range(6))
def test_steady_steps_through_one_staging_equal_brute_force(seed):
    """The fused layout kept in the staging between steps (query rows unchanged) gives the same
    CSR as a fresh construction, also when the rows, the padding or the block table change."""
    rng = random.Random(seed)
    page, max_blocks, rows = rng.choice([1, 4, 16]), 24, rng.randint(1, 8)
    staging = PlanStaging(16, 16 * max_blocks, depth=2)
    table = [[rng.randrange(1000) for _ in range(max_blocks)] for _ in range(16)]
    lens = [rng.randint(0, page * 4) for _ in range(16)]
    q, pad, non_causal = 1, 0, rng.random() < 0.5
    hits = 0
    for step in range(40):
        event = rng.random()
        if event < 0.1:  # a request joins or leaves
            rows = max(1, min(12, rows + rng.choice([-1, 1])))
        elif event < 0.15:  # other CUDA-graph padding
            pad = rng.randint(0, 2)
        elif event < 0.2:  # a block table row is rewritten (preemption, new request)
            table[rng.randrange(rows)] = [rng.randrange(1000) for _ in range(max_blocks)]
        elif event < 0.25 and non_causal:  # another draft block length
            q = rng.randint(1, 4)
        for i in range(rows):
            lens[i] = min(lens[i] + rng.choice([0, 1, 1, 3]), page * max_blocks)
        q_lens = [q] * rows + [0] * pad
        row_lens = [lens[i] for i in range(rows) for _ in range(q)]
        before = staging.fused_layout
        decode = _metadata(q_lens, row_lens, table[: rows + pad], not non_causal, 1)
        if non_causal:
            decode.causal = False
        total = rows + pad + rng.randint(0, 2) if rng.random() < 0.5 else None
        got = plan_hopper_decode(decode, page, "auto", num_requests=total, staging=staging)
        hits += staging.fused_layout is before and before is not None
        qo, kv_indptr, kv_lens, indices = _brute_force(q_lens, row_lens, table, page, True,
                                                       False, total)
        assert got.qo_indptr.tolist() == qo
        assert got.kv_indptr.tolist() == kv_indptr
        assert got.kv_len_arr.tolist() == kv_lens
        assert got.kv_indices.tolist() == indices
        assert got.has_empty_rows == (min(kv_lens) == 0)
    assert hits >= 10  # the held layout was actually reused


def test_a_block_table_narrower_than_the_pages_is_an_error():
    decode = _metadata([1, 1], [5, 40], [[1, 2], [3, 4]], True, 1)
    with pytest.raises(ValueError, match="block table"):
        plan_hopper_decode(decode, 16, "auto", staging=PlanStaging(4, 16, depth=2))


@pytest.mark.parametrize("causal", [False, True])
def test_the_workload_check_is_skipped_only_where_it_cannot_fail(monkeypatch, causal):
    """`_workload_surely_fits` lets a native re-plan skip FlashInfer's workload check. Against
    the planner model (tests/utils): every plan has at most num_clusters + plan_tile_bound
    work items (the claim it rests on), and it says True only where that bound is within
    FlashInfer's capacity, the KV within its int32 arithmetic and, causal, the query tile a
    multiple of the heads (where FlashInfer's causal tile check returns at once)."""
    import numpy as np

    from tests.utils.flashinfer_mla_plan_model import model_plan, plan_works
    from vllm.v1.attention.backends.mla import flashinfer_mla as fm
    device = torch.device("cuda", 0)  # a key only: nothing runs on a GPU
    rng = random.Random(11 + causal)
    said_yes = said_no = 0
    for _ in range(120):
        R = rng.randint(1, 24)
        heads = rng.choice([1, 4, 16, 24, 64, 128])
        q_lens = [rng.choice([1, 1, 2, 5, 8, 17]) for _ in range(R)]
        kv = [rng.randint(q, rng.choice([64, 900, 20000, 2**27])) for q in q_lens]
        sm = rng.choice([8, 66, 132, 16370])
        qo = np.cumsum([0] + q_lens).astype(np.int32)
        kv_np = np.array(kv, dtype=np.int32)
        kv_indptr = np.cumsum([0] + [-(-k // 16) for k in kv]).astype(np.int32)
        bound = fm.plan_tile_bound(int(qo[-1]), R, heads)
        if sm < 1000:  # the model's plan (a 16370-cluster plan is too slow to model here)
            info, scratch, _ = model_plan(qo, kv_np, kv_indptr, heads, num_sm=sm, causal=causal)
            works = plan_works(scratch.view(torch.int32).numpy(), info)
            assert len(works) <= info[1] + bound, (R, heads, q_lens, kv, sm)
        monkeypatch.setitem(fm._SM_COUNTS, device, sm)
        inputs = fm.HopperPlanInputs(
            qo_indptr=torch.from_numpy(qo), kv_indptr=torch.from_numpy(kv_indptr),
            kv_indices=torch.zeros(int(kv_indptr[-1]), dtype=torch.int32),
            kv_len_arr=torch.from_numpy(kv_np), causal=causal,
            arrays=(qo, kv_indptr, kv_np))
        tile = 128 if int(qo[-1]) * heads // R > 64 else 64
        want = (sm + bound <= 16384 and max(kv) * bound < 2**30
                and not (causal and tile % heads))
        got = fm._workload_surely_fits(inputs, heads, device)
        assert got == want, (R, heads, q_lens, kv, sm, causal)
        said_yes += got
        said_no += not got
    assert said_yes > 20 and said_no > 5  # both answers were exercised
    # no host arrays (an unstaged plan) or a CPU device: FlashInfer's check runs
    inputs.arrays = None
    assert not fm._workload_surely_fits(inputs, 16, device)
