"""FlashInfer MLA graph plans kept by chunk structure, put back on the device when a request's
chunk count changes (instead of a host build and a native re-plan).

Why: a held plan is refreshed or advanced for new lengths while every request keeps its chunk
count (flashinfer_plan_refresh.py). When one crosses a chunk edge the step builds its
metadata on the host and FlashInfer plans again. At B=1 on the tiny model the chunk limit is
32 tokens, so a DSpark engine (~3.4 tokens a step) crosses an edge every ~9 steps, and those
steps made a B=1 DSpark step's mean 0.18 ms longer than its median on the H100 node
(twenty-sixth session, run MD), which is the gap between issue #10's 1.5x and what it measured.

What makes a plan reusable: MLAPlan (FlashInfer 0.7.2, scheduler.cuh) cuts a request's KV at
multiples of `kv_len_limit` (kv_start += limit), the limit being a function of the batch's
total KV, and its merge entries and partial-output offsets follow from the chunk counts. The
length-dependent parts (each work's kv_len, the last chunk's kv_end, the works' first page)
are what refreshes and device lowerings rewrite. So a plan made once for a structure (the
query rows, the limit, every request's chunk count) is a valid plan for every length vector
of that structure, with the same chunk boundaries, hence the same output as a fresh plan (the
kernels' arithmetic depends on the boundaries, not on which cluster runs a chunk). Steady
decode passes the same structures request after request (B=1 from context 64 to 320: chunk
counts 3 to 10), so after the first request they are all here.

What is kept of a plan: the regions of the int workspace its kernels read (the eight per-work
arrays up to its work count, work_indptr, the five merge arrays, which MLAPlan writes whole),
gathered from the page-locked scratch right after the real plan into a small device image
with their positions (~17 KB for 80 works), and the plan's skeleton. Putting it back is one
stream-ordered index_copy_ into the wrapper's int workspace: no host sync, no planner. The
plan offsets (plan_info) of a graph wrapper are fixed (MLAPlan sizes every array for 16384
works); an entry whose plan_info differs from the wrapper's current one is not used.
VLLM_MLA_PLAN_CACHE=0 turns this off.

A lone request (B=1) would still re-plan at every chunk edge of the first request a wrapper
serves (a benchmark's only request, a chat's first turn), so the first real plan of a
one-request layout also plans every structure a lone request can reach up to the model's
length (single_request_lengths: 16 structures up to 512 tokens with 66 clusters, 210 up to
128k, 327 with 132 clusters; at most CAPACITY) with FlashInfer's own planner, which writes
only the page-locked scratch, and keeps them. That first plan is normally the graph
capture's (not while capturing: then it is the first steady step's).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from vllm.utils.env_flags import switch_flag
from vllm.utils.pinned_upload import upload
# (a module reference, its names looked up at call time: flashinfer_plan_refresh refers to
# this module the same way, so either may be imported first)
from vllm.v1.attention.backends.mla import flashinfer_plan_refresh as _refresh

PLAN_CACHE_FLAG = "VLLM_MLA_PLAN_CACHE"
# Per wrapper: structures kept (least recently used dropped first). A lone request up to 128k
# tokens passes through 210-327 (single_request_lengths); each entry is 8W + clusters + 5 SMs
# int32 values on the device (~10 KB at W = 200), their positions shared by entries of one
# work count.
CAPACITY = 512
_PER_WORK = ("q_indptr", "kv_indptr", "partial_indptr", "q_len", "kv_len", "q_start",
             "kv_start", "kv_end")
_MERGE = ("merge_packed_offset_start", "merge_packed_offset_end",
          "merge_partial_packed_offset_start", "merge_partial_packed_offset_end",
          "merge_partial_stride")


_CUDA: list[bool] = []


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (False without CUDA; the
    query itself raises on a host without a driver)."""
    if not _CUDA:
        _CUDA.append(torch.cuda.is_available())
    return _CUDA[0] and torch.cuda.is_current_stream_capturing()


def plan_cache_enabled() -> bool:
    return switch_flag(PLAN_CACHE_FLAG, True, "keep graph plans by chunk structure and put them "
                       "back on the device", "re-plan at every chunk count change")


def structure_of(lengths: np.ndarray, num_clusters: int) -> tuple[int, tuple]:
    """(limit, chunk counts) MLAPlan gives single-tile requests of these KV lengths (the
    padding requests' zeros included or not: they add nothing)."""
    kv = np.asarray(lengths, dtype=np.int64)
    limit = _refresh.limit_of_total(int(kv.sum()), num_clusters)
    counts = np.where(kv > limit, -(-kv // limit), 1)
    return limit, tuple(counts.tolist())


def single_request_lengths(max_len: int, num_clusters: int) -> list[int]:
    """The shortest length of every chunk structure (structure_of) a lone request of 1 to
    `max_len` tokens has, in order: the structure changes where the chunk count grows (past
    count * limit) or the limit does (past threshold * clusters: MLAPlan's limit is a step
    function of the average KV per cluster, with steps at 8, 16, 32, 64 and every 256)."""
    lengths, length = [], 1
    while length <= max_len:
        lengths.append(length)
        limit = _refresh.limit_of_total(length, num_clusters)
        average = -(-length // num_clusters)
        step = next((t for t in (8, 16, 32, 64) if t >= average), -(-average // 256) * 256)
        length = min(_refresh.chunk_count(length, limit) * limit, step * num_clusters) + 1
    return lengths


def plan_regions(info: list[int], num_works: int) -> np.ndarray:
    """int32 positions in the int workspace of what a plan's kernels read (see the module
    docstring), from its plan_info (MLAPlanInfo::ToVector order) and work count."""
    at = dict(zip(_refresh.PLAN_INFO_FIELDS, info))
    # the merge arrays are num_SMs long each, allocated back to back (16-byte aligned)
    merge_len = (at["merge_packed_offset_end"] - at["merge_packed_offset_start"]) // 4
    spans = [(at[f] // 4, num_works) for f in _PER_WORK]
    spans += [(at[f] // 4, merge_len) for f in _MERGE]
    spans.append((at["work_indptr"] // 4, at["num_blks_y"] + 1))
    return np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in spans])


def serves(skeleton, lower: np.ndarray, upper: np.ndarray, num_clusters: int,
           draft: bool) -> bool:
    """Whether a plan of `skeleton`, a plan of the lower bound's structure (or, for a draft
    plan, of any structure), is valid for every length vector between `lower` and `upper`:
    exact lengths always; else a verify plan (its split decides the output) only where the
    upper bound has its structure too, a draft plan (its split decides nothing) where both
    bounds are within its skeleton's bounds."""
    if lower is upper or np.array_equal(lower, upper):
        return True
    if draft:
        return bool((lower > skeleton.lo).all() and (upper <= skeleton.hi).all())
    return structure_of(upper, num_clusters) == (skeleton.limit, skeleton.counts)


@dataclass
class CachedPlan:
    skeleton: object        # PlanSkeleton of the plan
    info: tuple             # its plan_info
    index: torch.Tensor     # [N] int64 positions in the int32 workspace (device; shared)
    values: torch.Tensor    # [N] int32 the plan's values there (device)


class PlanCache:
    """One wrapper's plans by structure (key: the planned query rows, the limit, the chunk
    counts). `store` after a real plan, `find` for new lengths, `put_back` onto the device."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._entries: OrderedDict[tuple, CachedPlan] = OrderedDict()
        self.warmed: set[bytes] = set()  # one-request layouts whose structures were planned
        self._indexes: dict[tuple, tuple] = {}  # (plan_info, works) -> (positions, device index)
        self.stores = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def holds(self, qo_bytes: bytes, limit: int, counts: tuple) -> bool:
        return (qo_bytes, limit, counts) in self._entries

    def store(self, skeleton, info: tuple, pinned_ws: torch.Tensor, device) -> None:
        """Keep the plan FlashInfer just wrote into `pinned_ws` (its page-locked scratch),
        whose skeleton is `skeleton`; a structure already kept keeps its first plan."""
        key = (skeleton.qo_bytes, skeleton.limit, skeleton.counts)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        positions, _ = self._index(info, skeleton.num_works, device)
        self.store_values(skeleton, info, pinned_ws.view(torch.int32).numpy()[positions],
                          device)

    def _index(self, info: tuple, num_works: int, device) -> tuple:
        """(host positions, device index) of a plan's regions, shared by entries alike."""
        shared = self._indexes.get((info, num_works))
        if shared is None:
            positions = plan_regions(list(info), num_works)
            # (through a pinned ring: no page-locked allocation, no wait for the stream)
            shared = self._indexes[(info, num_works)] = (positions, upload(positions, device))
        return shared

    def store_values(self, skeleton, info: tuple, values: np.ndarray, device) -> CachedPlan:
        """Keep a plan given by its values at plan_regions(info, works) (a plan written on the
        host: flashinfer_host_plan.workspace_values); returns its entry (a structure already
        kept keeps its first plan)."""
        key = (skeleton.qo_bytes, skeleton.limit, skeleton.counts)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            return entry
        positions, index = self._index(info, skeleton.num_works, device)
        if values.shape != positions.shape:
            raise ValueError(f"a plan of {skeleton.num_works} works has {positions.shape[0]} "
                             f"workspace values, not {values.shape[0]}")
        kept = upload(np.asarray(values, dtype=np.int32), device)
        entry = self._entries[key] = CachedPlan(skeleton, tuple(info), index, kept)
        self.stores += 1
        if len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return entry

    def find(self, qo_bytes: bytes, lower: np.ndarray, upper: np.ndarray, num_clusters: int,
             draft: bool) -> CachedPlan | None:
        """A kept plan valid for every length vector between `lower` and `upper` (the real
        requests' bounds; exact lengths: lower is upper): its structure is the lower bound's,
        and the upper bound's fits it too, as the same structure (a verify plan: its split
        decides the output) or within its skeleton's bounds (a draft plan, whose split
        decides nothing)."""
        limit, counts = structure_of(lower, num_clusters)
        key = (qo_bytes, limit, counts)
        entry = self._entries.get(key)
        if entry is None:
            return None
        if not serves(entry.skeleton, lower, upper, num_clusters, draft):
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    @staticmethod
    def put_back(entry: CachedPlan, int_workspace: torch.Tensor) -> None:
        """Write the kept plan into the wrapper's int workspace (stream-ordered)."""
        int_workspace.view(torch.int32).index_copy_(0, entry.index, entry.values)
