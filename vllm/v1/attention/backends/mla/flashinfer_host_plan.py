"""FlashInfer MLA (fa3) plans written on the host: FlashInfer 0.7.2's `MLAPlan`
(include/flashinfer/attention/scheduler.cuh) followed step by step in Python, so that a graph
wrapper whose requests reach a chunk structure the plan cache does not hold gets its plan
without FlashInfer's planner, its Python layers and the read-back of what it wrote.

Why: in a batch whose lengths drifted apart (uneven acceptance; the cannot-pay policy's probe
steps) each request crosses a chunk edge in a step of its own, and every such step re-planned
natively: ~0.66 ms of host time a time at B=8 on the tiny model (the planner, its staging copy,
the host build of the step's page lists and `PlanSkeleton.from_plan`'s read-back; thirty-first
session, run QD), 23 of 150 steps, two thirds of what issue #15's cannot-pay engine lost at B=8.
Such structures rarely recur, so the plan cache (flashinfer_plan_cache.py) held none of them. A
plan written here goes into the cache and is put back the way a kept plan is: one index copy
into the int workspace, the page lists and lengths written on the device.

What MLAPlan does, for the record (scheduler.cuh, MLAPlan):
  * cluster_size 2 when the average packed query rows per request (q_len * heads, integer
    average over every request, padding requests included) exceed 64, else 1; clusters =
    num_SMs // cluster_size; a query tile is 64 * cluster_size packed rows;
  * kv_len_limit: f(max(ceil(total / clusters), 1)) over every tile's effective KV (causal: a
    tile's KV ends at its last row, the last tile sees all; flashinfer_plan_refresh's
    _limit_of_average is f);
  * requests in order, each one's tiles from the last to the first: KV longer than the limit
    is split, with merge entries (ceil(rows / chunks) rows each, chunks = max(kv *
    cluster_size // limit, 1)) and a partial-output slot of `rows` per chunk; every chunk
    (and one empty chunk for an empty KV) goes to the cluster the planner's min-heap pops,
    whose cost then grows by 2 * tile + the chunk's length (float);
  * the per-work arrays are the clusters' lists concatenated, at fixed offsets sized for
    16384 works (so a wrapper's plan_info never changes with its lengths).

Which cluster pops first among equal costs is decided by libstdc++'s std::pop_heap /
std::push_heap (the planner's MinHeap keeps a vector heap with a `>` comparator and starts from
clusters 0..n-1 at cost 0), so `_StdMinHeap` follows those two algorithms (stl_heap.h:
__adjust_heap, __push_heap) element move by element move. The plan written here is then
FlashInfer's own, byte for byte (tests/v1/attention/test_flashinfer_mla_gpu.py compares it
with the native planner's on the GPU), and the cluster of a chunk is no new assumption: the
plan cache already puts back plans made for other lengths of a structure.

VLLM_MLA_HOST_PLANS=0 goes back to the native planner for every structure the cache lacks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm.utils.env_flags import switch_flag
# (module references: both modules import this one's names at call time)
from vllm.v1.attention.backends.mla import flashinfer_plan_cache as _cache
from vllm.v1.attention.backends.mla import flashinfer_plan_refresh as _refresh

HOST_PLANS_FLAG = "VLLM_MLA_HOST_PLANS"
# The planner's costs are float32 sums of whole numbers; Python adds them exactly, so the two
# agree while every partial sum is below 2**24. Larger workloads go to the native planner.
_EXACT_FLOAT32 = 1 << 24


def host_plans_enabled() -> bool:
    return switch_flag(HOST_PLANS_FLAG, True, "write plans for chunk structures the plan cache "
                       "lacks on the host", "plan them with FlashInfer's native planner")


class _StdMinHeap:
    """FlashInfer's MinHeap ((cluster, cost) pairs, the least cost on top) with libstdc++'s
    heap algorithms, so that ties pop in the planner's order. `pop` then `push` of one cluster
    is all the planner does."""

    def __init__(self, n: int):
        self.index = list(range(n))
        self.cost = [0] * n  # whole numbers (the float32 costs, exact: see _EXACT_FLOAT32)

    def pop(self) -> tuple[int, int]:
        index, cost = self.index, self.cost
        top = (index[0], cost[0])
        n = len(index) - 1
        if n > 0:  # std::pop_heap: the last element refills the hole left at the root
            value = (index[n], cost[n])
            index[n], cost[n] = top
            self._adjust(0, n, value)
        index.pop()
        cost.pop()
        return top

    def push(self, cluster: int, value: int) -> None:
        self.index.append(cluster)
        self.cost.append(value)
        self._up(len(self.index) - 1, 0, (cluster, value))

    def _adjust(self, hole: int, length: int, value: tuple[int, int]) -> None:
        # std::__adjust_heap: move the hole down to a leaf along the child that is not
        # "less" (comp(a, b) = a.cost > b.cost: the right child unless it costs more), then
        # push the value up from there
        index, cost = self.index, self.cost
        top, child = hole, hole
        while child < (length - 1) // 2:
            child = 2 * (child + 1)
            if cost[child] > cost[child - 1]:
                child -= 1
            index[hole], cost[hole] = index[child], cost[child]
            hole = child
        if length % 2 == 0 and child == (length - 2) // 2:
            child = 2 * (child + 1)
            index[hole], cost[hole] = index[child - 1], cost[child - 1]
            hole = child - 1
        self._up(hole, top, value)

    def _up(self, hole: int, top: int, value: tuple[int, int]) -> None:
        # std::__push_heap: parents that compare "less" than the value (cost more) move down
        index, cost = self.index, self.cost
        parent = (hole - 1) // 2
        while hole > top and cost[parent] > value[1]:
            index[hole], cost[hole] = index[parent], cost[parent]
            hole = parent
            parent = (hole - 1) // 2
        index[hole], cost[hole] = value


@dataclass
class HostPlan:
    """One MLAPlan, as the kernels read it (per-work arrays in cluster order)."""

    cluster_size: int
    num_clusters: int
    limit: int
    works: dict            # field of _cache._PER_WORK -> list of values, one per work
    work_indptr: list      # [clusters + 1]
    merges: list           # (packed start, packed end, partial start, partial end, stride)
    work_req: list         # the request of each work
    last_of_request: list  # per work: whether it is its request's last chunk (single tile)


def causal_kv_end(q_len: int, kv_len: int, tile_idx: int, tile: int, num_tiles: int,
                  num_heads: int) -> int:
    """packed_causal_kv_end: the KV a causal query tile sees (bottom-right aligned)."""
    if tile_idx + 1 == num_tiles:
        return kv_len
    return max(min(kv_len - q_len + -(-((tile_idx + 1) * tile) // num_heads), kv_len), 0)


def mla_plan(qo_indptr, kv_indptr, kv_lens, num_heads: int, num_sm: int,
             causal: bool) -> HostPlan | None:
    """MLAPlan for these requests (host arrays or lists), or None where this cannot promise
    FlashInfer's plan (costs past float32's exact range; more merge entries than SMs, which
    FlashInfer would refuse)."""
    qo = [int(v) for v in qo_indptr]
    kv_ptr = [int(v) for v in kv_indptr]
    kv = [int(v) for v in kv_lens]
    batch = len(kv)
    if batch == 0 or len(qo) != batch + 1 or len(kv_ptr) < batch:
        raise ValueError(f"mla_plan needs qo_indptr of {batch + 1} and kv_indptr of at least "
                         f"{batch} entries for {batch} lengths")
    q_lens = [b - a for a, b in zip(qo, qo[1:])]
    if min(q_lens) < 0:
        raise ValueError(f"qo_indptr must not decrease: {qo}")
    cluster_size = 2 if sum(q * num_heads for q in q_lens) // batch > 64 else 1
    num_clusters = num_sm // cluster_size
    tile = _refresh._CTA_TILE_Q * cluster_size
    tiles = [-(-(q * num_heads) // tile) for q in q_lens]

    def effective(i: int, t: int) -> int:
        if not causal:
            return kv[i]
        return causal_kv_end(q_lens[i], kv[i], t, tile, tiles[i], num_heads)

    total = sum(effective(i, t) for i in range(batch) for t in range(tiles[i]))
    limit = _refresh.limit_of_total(total, num_clusters)
    heap = _StdMinHeap(num_clusters)
    per_cluster = [[] for _ in range(num_clusters)]
    merges: list = []
    partial_nnz = 0
    work_cost = 2 * tile
    spent = 0  # every cost added: a bound on any cluster's cost
    for i in range(batch):
        packed = q_lens[i] * num_heads
        for t in range(tiles[i] - 1, -1, -1):
            remaining = effective(i, t)
            start = 0
            split = remaining > limit
            rows = min(tile, packed - t * tile)
            if split:
                chunks = max(remaining * cluster_size // limit, 1)
                step = -(-rows // chunks)
                base = qo[i] * num_heads + t * tile
                end = partial_nnz + -(-remaining // limit) * rows
                for off in range(0, rows, step):
                    merges.append((base + off, base + min(off + step, rows),
                                   partial_nnz + off, end, rows))
            zero = remaining == 0
            while remaining > 0 or zero:
                cluster, cost = heap.pop()
                actual = min(remaining, limit)
                spent += work_cost + actual
                heap.push(cluster, cost + work_cost + actual)
                part = -1
                if split:
                    part = partial_nnz
                    partial_nnz += rows
                remaining -= actual
                per_cluster[cluster].append((qo[i], kv_ptr[i], part, q_lens[i], kv[i], t * tile,
                                             start, start + actual, i,
                                             remaining == 0 and t == 0))
                start += actual
                if zero:
                    break
    if spent >= _EXACT_FLOAT32 or len(merges) > num_sm:
        return None
    flat = [w for works in per_cluster for w in works]
    columns = list(zip(*flat)) if flat else [()] * 10
    work_indptr = [0]
    for works in per_cluster:
        work_indptr.append(work_indptr[-1] + len(works))
    return HostPlan(cluster_size=cluster_size, num_clusters=num_clusters, limit=limit,
                    works={f: list(columns[k]) for k, f in enumerate(_cache._PER_WORK)},
                    work_indptr=work_indptr, merges=merges, work_req=list(columns[8]),
                    last_of_request=list(columns[9]))


def workspace_values(plan: HostPlan, info) -> np.ndarray:
    """The plan's int32 values at `_cache.plan_regions(info, works)`'s positions, in their
    order: the eight per-work arrays, the five merge arrays (MLAPlan writes num_SMs entries
    each, zeros past its merge entries; the regions' alignment padding gets zeros here) and
    work_indptr."""
    at = dict(zip(_refresh.PLAN_INFO_FIELDS, [int(v) for v in info]))
    merge_len = (at["merge_packed_offset_end"] - at["merge_packed_offset_start"]) // 4
    merges = np.zeros((5, merge_len), dtype=np.int32)
    if plan.merges:
        merges[:, :len(plan.merges)] = np.array(plan.merges, dtype=np.int64).T
    per_work = np.array([plan.works[f] for f in _cache._PER_WORK], dtype=np.int32)
    return np.concatenate([per_work.reshape(-1), merges.reshape(-1),
                           np.asarray(plan.work_indptr, dtype=np.int32)])


def skeleton_of(plan: HostPlan, qo_indptr: np.ndarray, kv_lens: np.ndarray, num_heads: int,
                causal: bool, info, draft: bool = False):
    """The PlanSkeleton of a host plan, the one PlanSkeleton.from_plan reads back from the
    same plan in FlashInfer's scratch, without the read-back (None where from_plan gives None:
    requests over several query tiles, padding requests out of place, another plan_info)."""
    info = tuple(int(v) for v in info)
    if info[:2] != (plan.cluster_size, plan.num_clusters):
        return None
    qo = qo_indptr.tolist()
    kv = kv_lens.tolist()
    q_lens = [b - a for a, b in zip(qo, qo[1:])]
    num_real = sum(1 for q in q_lens if q > 0)
    if (num_real == 0 or min(q_lens[:num_real]) <= 0 or any(kv[num_real:])
            or max(q_lens) * num_heads > plan.cluster_size * _refresh._CTA_TILE_Q):
        return None
    counts = [0] * num_real
    for r in plan.work_req:
        counts[r] += 1
    # (in request order, as from_plan lists them)
    last = sorted((plan.work_req[j], j) for j, is_last in enumerate(plan.last_of_request)
                  if is_last)
    return _refresh.PlanSkeleton.of_works(
        qo_indptr, num_real, plan.work_req, [j for _, j in last], [r for r, _ in last],
        plan.works["kv_end"], counts, plan.limit, info, num_heads, causal, draft)
