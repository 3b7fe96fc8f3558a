"""A model of FlashInfer 0.7.2's MLA (fa3) planner for CPU tests, and a checker of its plans.

`model_plan` follows the algorithm of `MLAPlan` (flashinfer/attention/scheduler.cuh), causal
or not: KV cut into chunks of at most the planner's limit, chunks dealt to the least
loaded cluster, the work arrays written at 16-byte aligned offsets of an int scratch buffer
sized for 16384 work items each. Its cluster costs are a stand-in (tests never depend on which
cluster a chunk lands on). `plan_works` reads a plan back the way the kernels do, and
`assert_valid_plan` checks that the plan covers every request's KV exactly.
"""
from __future__ import annotations

import heapq

import numpy as np
import torch

MAX_WORKS = 16384
FIELDS = ("q_indptr", "kv_indptr", "partial_indptr", "merge_packed_offset_start",
          "merge_packed_offset_end", "merge_partial_packed_offset_start",
          "merge_partial_packed_offset_end", "merge_partial_stride", "q_len", "kv_len",
          "q_start", "kv_start", "kv_end", "work_indptr")
MERGE_FIELDS = FIELDS[3:8]


def limit_of(total: int, num_clusters: int) -> int:
    x = max(-(-total // num_clusters), 1)
    for bound, value in ((8, 32), (16, 64), (32, 128), (64, 192)):
        if x <= bound:
            return value
    return -(-x // 256) * 256


def causal_kv_end(q_len: int, kv_len: int, tile_idx: int, tile: int, num_tiles: int,
                  num_heads: int) -> int:
    """MLAPlan's effective KV of a causal query tile (packed_causal_kv_end): the last tile
    sees the whole KV, an earlier one only up to its last row (bottom-right aligned)."""
    if tile_idx + 1 == num_tiles:
        return kv_len
    return max(min(kv_len - q_len + -(-((tile_idx + 1) * tile) // num_heads), kv_len), 0)


def model_plan(qo, kv, kv_indptr, num_heads: int, num_sm: int = 8, causal: bool = False):
    """(plan_info list, uint8 scratch tensor) of a plan for these requests (causal: each query
    tile's KV ends at its effective end, as MLAPlan does)."""
    qo, kv, kv_indptr = (list(map(int, a)) for a in (qo, kv, kv_indptr))
    batch = len(kv)
    q_lens = [qo[i + 1] - qo[i] for i in range(batch)]
    avg = sum(q * num_heads for q in q_lens) // batch
    cluster_size = 2 if avg > 64 else 1
    clusters = num_sm // cluster_size
    tile = 64 * cluster_size
    tiles = [-(-(q * num_heads) // tile) for q in q_lens]
    def effective(i, t):
        return (causal_kv_end(q_lens[i], kv[i], t, tile, tiles[i], num_heads) if causal
                else kv[i])

    limit = limit_of(sum(effective(i, t) for i in range(batch) for t in range(tiles[i])),
                     clusters)
    heap = [(0, c) for c in range(clusters)]
    per_cluster = [[] for _ in range(clusters)]
    merges, partial_nnz = [], 0
    for i in range(batch):
        packed = q_lens[i] * num_heads
        for t in reversed(range(tiles[i])):
            remaining, start = effective(i, t), 0
            split = remaining > limit
            rows = min(tile, packed - t * tile)
            if split:
                chunks = max(remaining * cluster_size // limit, 1)
                step = -(-rows // chunks)
                for off in range(0, rows, step):
                    merges.append((qo[i] * num_heads + t * tile + off,
                                   qo[i] * num_heads + t * tile + min(off + step, rows),
                                   partial_nnz + off,
                                   partial_nnz + -(-remaining // limit) * rows, rows))
            zero = remaining == 0
            while remaining > 0 or zero:
                cost, c = heapq.heappop(heap)
                actual = min(remaining, limit)
                heapq.heappush(heap, (cost + actual + 16, c))
                part = -1
                if split:
                    part = partial_nnz
                    partial_nnz += rows
                per_cluster[c].append(dict(q_indptr=qo[i], kv_indptr=kv_indptr[i],
                                           partial_indptr=part, q_len=q_lens[i], kv_len=kv[i],
                                           q_start=t * tile, kv_start=start,
                                           kv_end=start + actual))
                remaining -= actual
                start += actual
                if zero:
                    break
    works = [w for cluster in per_cluster for w in cluster]
    work_indptr = np.cumsum([0] + [len(c) for c in per_cluster])
    offsets, at = {}, 0
    for f in FIELDS:
        offsets[f] = at
        size = 4 * (num_sm if f in MERGE_FIELDS else MAX_WORKS)
        at += -(-size // 16) * 16
    scratch = torch.full((at,), 0xAB, dtype=torch.uint8)  # garbage outside what is written
    ws = scratch.view(torch.int32).numpy()
    for f in FIELDS:
        if f == "work_indptr":
            values = work_indptr
        elif f in MERGE_FIELDS:
            k = MERGE_FIELDS.index(f)
            values = np.zeros(num_sm, dtype=np.int64)
            values[: len(merges)] = [m[k] for m in merges]
        else:
            values = [w[f] for w in works]
        ws[offsets[f] // 4: offsets[f] // 4 + len(values)] = values
    info = [cluster_size, clusters, *(offsets[f] for f in FIELDS), at, at + 4096]
    return info, scratch, limit


def plan_works(ws_i32: np.ndarray, info) -> list[dict]:
    """Every work item of a plan as the kernels read it from the int workspace."""
    offsets = dict(zip(FIELDS, info[2:16]))
    num_clusters = info[1]
    wi = ws_i32[offsets["work_indptr"] // 4: offsets["work_indptr"] // 4 + num_clusters + 1]
    n = int(wi[-1])
    return [{f: int(ws_i32[offsets[f] // 4 + w]) for f in FIELDS
             if f not in MERGE_FIELDS and f != "work_indptr"} for w in range(n)]


def assert_valid_plan(works, qo, kv, kv_indptr, chunk_limit: int, chunk_counts=None,
                      last_chunk_limit: int | None = None) -> None:
    """Each request with query rows is covered by its works: chunks tile [0, kv) in order,
    none longer than chunk_limit (a request's last one: last_chunk_limit, default the same;
    a refreshed plan lets it grow), with the request's kv_len and first page. `chunk_counts`
    (request -> count) pins the number of chunks too."""
    last_limit = chunk_limit if last_chunk_limit is None else last_chunk_limit
    q_lens = [int(qo[i + 1]) - int(qo[i]) for i in range(len(kv))]
    for i, q in enumerate(q_lens):
        if q == 0:
            continue
        mine = sorted((w for w in works if w["q_indptr"] == int(qo[i])),
                      key=lambda w: w["kv_start"])
        assert mine, f"request {i} has no work item"
        pos = 0
        for n, w in enumerate(mine):
            assert w["kv_start"] == pos, (i, mine)
            assert w["kv_end"] > w["kv_start"] or int(kv[i]) == 0, (i, w)  # no empty chunk
            bound = last_limit if n + 1 == len(mine) else chunk_limit
            assert w["kv_end"] - w["kv_start"] <= bound, (i, w, bound)
            assert w["kv_len"] == int(kv[i]) and w["kv_indptr"] == int(kv_indptr[i]), (i, w)
            assert w["q_len"] == q
            pos = w["kv_end"]
        assert pos == int(kv[i]), (i, pos, int(kv[i]))
        if chunk_counts is not None:
            assert len(mine) == chunk_counts[i], (i, len(mine), chunk_counts[i])


# The per-work arrays of a plan (everything the kernels read per work item).
WORK_FIELDS = ("q_indptr", "kv_indptr", "partial_indptr", "q_len", "kv_len", "q_start",
               "kv_start", "kv_end")


def permute_clusters(ws_i32: torch.Tensor, info, order) -> None:
    """Deal a plan's work items to other clusters, in place (any device): cluster c gets the
    works cluster order[c] had, in their order. Every work keeps all its fields (its chunk,
    its partial slot), so the plan covers the same chunks and merges the same partials in the
    same order; only which cluster computes a chunk changes (the question a host-written plan
    raises: does that change any output bit?)."""
    info = [int(v) for v in info]
    offsets = dict(zip(FIELDS, info[2:16]))
    clusters = info[1]
    if sorted(order) != list(range(clusters)):
        raise ValueError(f"order must be a permutation of the {clusters} clusters")
    host = ws_i32.cpu().clone()
    start = offsets["work_indptr"] // 4
    indptr = host[start:start + clusters + 1].tolist()
    num_works = indptr[-1]
    positions = torch.tensor([w for c in order for w in range(indptr[c], indptr[c + 1])],
                             dtype=torch.int64)
    for field in WORK_FIELDS:
        base = offsets[field] // 4
        host[base:base + num_works] = host[base:base + num_works][positions]
    sizes = [indptr[c + 1] - indptr[c] for c in order]
    host[start:start + clusters + 1] = torch.tensor(np.cumsum([0] + sizes), dtype=torch.int32)
    ws_i32.copy_(host)
