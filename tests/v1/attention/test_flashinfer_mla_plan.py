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
