"""Refresh a FlashInfer MLA (Hopper, fa3) plan for new KV lengths without re-planning.

Why: in steady decode every request's KV grows by one token per step, and FlashInfer's planner
(`MLAPlan`, scheduler.cuh) is re-run from scratch each step: the C++ scheduler, FlashInfer's
Python workload check (lists of every request) and a pinned staging copy of the 11 work arrays
it sizes for 16384 work items (~0.7 MiB) every call. On an H200 node that is ~0.6 ms of host time
per step at B=32 (scripts/probe_decode_step.py), about half of the step's GPU time, in a step the
host already bounds.

What a plan is (FlashInfer 0.7.2, read from scheduler.cuh): the KV range of every planned request
is cut into chunks of at most `kv_len_limit` tokens, one *work item* per chunk, and the work items
are dealt to clusters; a request cut into more than one chunk also gets merge entries that combine
its chunks' partial outputs. Per work item the int workspace holds q_indptr, kv_indptr,
partial_indptr, q_len, kv_len (the request's whole length), q_start, kv_start and kv_end.

When the query rows are unchanged and every request keeps its number of chunks, the old plan is
still a valid plan for the new lengths once three per-work arrays are rewritten: kv_len, kv_indptr
(the request's first page in the new CSR) and kv_end of each request's last chunk. Everything
else (the cluster assignment, partial and merge offsets, the block counts) depends only on the
chunk structure. The kernels do not know `kv_len_limit` (a work item loops over its own
[kv_start, kv_end)), so the last chunk may grow past it: a refresh accepts a last chunk of up to
limit + refresh_slack(limit) tokens (0 unless VLLM_MLA_REFRESH_SLACK_TOKENS asks for more; see
DEFAULT_SLACK_TOKENS; a block drafter's draft plans take 128 unless
VLLM_MLA_DRAFT_REFRESH_SLACK_TOKENS says otherwise: no output depends on their split). Why: a real plan is needed whenever ANY request would change
its chunk count. Requests whose lengths drifted apart (uneven acceptance, policy probes) cross
chunk edges in different steps, so without slack a batch of B drifted requests re-plans B times
per `limit` tokens where a lock-step batch re-plans once (tiny model, B=8: 51 against 10 re-plans
in 736 steps, fourteenth session, ~0.3 ms of host time each). With slack every request has at
least `slack` tokens of headroom after any real plan, so re-plans come at most once per `slack`
tokens of growth whatever the drift. The price is balance: the cluster holding a grown chunk
does up to `slack` tokens more work than the planner gave it, bounded by 128 tokens (one or two
KV tiles) so that long contexts, where the attention kernel sets the step time, lose at most a
fraction 128 / limit of one cluster's balance; the next real plan rebuilds it.

`PlanSkeleton.from_plan` reads a plan back from FlashInfer's pinned scratch (where the C++ planner
wrote it, synchronously) and checks it against the layout above; anything it does not recognise
(requests over several query tiles, another FlashInfer layout) gives None and the caller keeps
re-planning.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm.triton_utils import HAS_TRITON
from vllm.utils.cuda_streams import record_event
from vllm.utils.pinned_upload import upload
# (a module reference: flashinfer_plan_cache reads this module's planner arithmetic the same
# way, so either may be imported first)
from vllm.v1.attention.backends.mla import flashinfer_plan_cache as _cache
from vllm.v1.attention.backends.mla import flashinfer_host_plan as _host
from vllm.v1.attention.backends.mla.plan_lowering import (PlanLowering, rebuild_csr_torch,
                                                          rebuild_csr_triton)

# MLAPlanInfo::ToVector order (scheduler.cuh); byte offsets into the int workspace.
PLAN_INFO_FIELDS = (
    "num_blks_x", "num_blks_y", "q_indptr", "kv_indptr", "partial_indptr",
    "merge_packed_offset_start", "merge_packed_offset_end", "merge_partial_packed_offset_start",
    "merge_partial_packed_offset_end", "merge_partial_stride", "q_len", "kv_len", "q_start",
    "kv_start", "kv_end", "work_indptr", "partial_o", "partial_lse")
_CTA_TILE_Q = 64  # rows of one CTA's query tile in the fa3 MLA kernel


def _ceil_div(a, b):
    return -(-a // b)


def _limit_of_average(x: int) -> int:
    """MLAPlan's kv_len_limit from the average KV per cluster (its lambda `f`)."""
    if x <= 8:
        return 32
    if x <= 16:
        return 64
    if x <= 32:
        return 128
    if x <= 64:
        return 192
    return _ceil_div(x, 256) * 256


def kv_len_limit(qo_indptr: np.ndarray, kv_lens: np.ndarray, num_heads: int,
                 cluster_size: int, num_clusters: int) -> int:
    """The chunk length MLAPlan cuts non-causal requests at (same integer arithmetic)."""
    q_lens = (qo_indptr[1:] - qo_indptr[:-1]).astype(np.int64)
    tile = cluster_size * _CTA_TILE_Q
    tiles = _ceil_div(q_lens * num_heads, tile)
    return limit_of_total(int((kv_lens.astype(np.int64) * tiles).sum()), num_clusters)


def limit_of_total(total_kv: int, num_clusters: int) -> int:
    """kv_len_limit from the tile-weighted KV total (the sum of the lengths when every request
    is one query tile)."""
    return _limit_of_average(max(_ceil_div(total_kv, num_clusters), 1))


REFRESH_SLACK_TOKENS = 128  # the bound the module docstring argues for (set it through the flag)
SLACK_FLAG = "VLLM_MLA_REFRESH_SLACK_TOKENS"
# Off unless asked for: a plan's chunk split then depends on when it was last made, so engines
# with other histories (a speculative one beside a plain one) split the same lengths
# differently, and bf16 rounding of the merged chunks can flip greedy near-ties between them.
# Whether it flips more of them than the history-dependent limit already does was not
# measured (sixteenth session, docs/performance.md); nor was a tok/s gain beyond noise.
DEFAULT_SLACK_TOKENS = 0


# Draft plans (a block drafter's non-causal draft block) are another matter: drafts are verified,
# so no output token depends on how a draft plan splits the KV, and their plans may take the
# slack by default. It is the plan a speculative step re-plans most (a DSpark engine at B=8 on
# the tiny model re-planned its draft wrapper natively in 0.43 of its steps, its verify wrapper
# in 0.25, seventeenth session, H100): every request's draft KV grows by 1 to k + 1 tokens a
# step, by its own acceptance, so chunk edges are crossed in many more steps than in decode.
DRAFT_SLACK_FLAG = "VLLM_MLA_DRAFT_REFRESH_SLACK_TOKENS"
DEFAULT_DRAFT_SLACK_TOKENS = REFRESH_SLACK_TOKENS


def _slack_bound(flag: str, default: int) -> int:
    bound = os.environ.get(flag)
    if bound is None:
        return default
    if not bound.isdigit():
        raise ValueError(f"{flag}={bound!r} is invalid: use a whole number of tokens >= 0 "
                         f"(0: a request's chunk count change re-plans; "
                         f"{REFRESH_SLACK_TOKENS}: the bound the module docstring argues for)")
    return int(bound)


def refresh_slack(limit: int, draft: bool = False) -> int:
    """Tokens a request's last chunk may grow past `limit` before its plan is remade (the
    module docstring says why): the limit itself, at most the bound VLLM_MLA_REFRESH_SLACK_TOKENS
    gives (default DEFAULT_SLACK_TOKENS), or for `draft` plans (a block drafter's draft block,
    whose split no output depends on) VLLM_MLA_DRAFT_REFRESH_SLACK_TOKENS (default
    DEFAULT_DRAFT_SLACK_TOKENS). Read at every real plan, which costs far more."""
    if draft:
        return min(int(limit), _slack_bound(DRAFT_SLACK_FLAG, DEFAULT_DRAFT_SLACK_TOKENS))
    return min(int(limit), _slack_bound(SLACK_FLAG, DEFAULT_SLACK_TOKENS))


def chunk_count(kv_len: int, limit: int) -> int:
    """Work items of a (single-tile) request: 1 up to the limit, else ceil(kv / limit)."""
    return _ceil_div(kv_len, limit) if kv_len > limit else 1


@dataclass
class PlanSkeleton:
    """The length-independent part of one FlashInfer MLA plan, and how to refresh it."""

    qo_indptr: np.ndarray   # [R+1] the planned query rows (a refresh needs them unchanged)
    num_real: int           # requests with query rows; the rest are empty padding requests
    lo: np.ndarray          # [num_real] new kv must be > lo (no chunk may empty) ...
    hi: np.ndarray          # [num_real] ... and <= hi (the last chunk within limit + slack)
    work_req: np.ndarray    # [W] planned request of each work item (padding works -> num_real)
    last_work: np.ndarray   # work items that end a request's KV range
    last_req: np.ndarray    # their requests
    kv_end: np.ndarray      # [W] the plan's kv_end (non-last chunks keep theirs)
    offsets: dict           # int32 element offsets of kv_indptr, kv_len, kv_end
    num_works: int
    # the planned qo_indptr as given (bytes, dtype): `fits` compares the next step's in one go
    qo_bytes: bytes = b""
    qo_dtype: np.dtype | None = None
    ends_are_lengths: bool = False  # every real work is its request's last (one chunk each)
    limit: int = 0                  # the plan's kv_len_limit (diagnostics and tests)
    counts: tuple = ()              # the real requests' chunk counts (a plan cache's key)
    num_clusters: int = 0           # the plan's clusters (its limit is a function of them)
    info: tuple = ()                # the plan's plan_info (a kept plan must have the same)
    num_heads: int = 0              # the plan's query heads and causal flag: what a plan for
    causal: bool = False            # other lengths of these rows is made with (host plans)
    # device tensors made from this skeleton once (lower_on_device's index, the page-list
    # rebuild's work -> request map): a skeleton put back from a plan cache brings them along
    device: dict = field(default_factory=dict)

    @classmethod
    def from_plan(cls, plan_info, pinned_ws: torch.Tensor, qo_indptr: np.ndarray,
                  kv_lens: np.ndarray, num_heads: int, causal: bool,
                  draft: bool = False) -> "PlanSkeleton | None":
        """Read the plan FlashInfer just wrote into `pinned_ws` (its page-locked int scratch)
        for requests (qo_indptr, kv_lens). None when the plan is not of the recognised form.
        `draft`: a draft block's plan, refreshed with the draft slack (refresh_slack)."""
        # Causal plans are refreshed only when every request is one query tile (checked below
        # with the other tile conditions): MLAPlan gives a request's last (here: only) tile the
        # request's whole KV as its effective length (packed_causal_kv_end), so such a plan is
        # cut exactly as the non-causal one, and the kernel applies the causal mask from q_len
        # and kv_len, both rewritten by a refresh. Earlier tiles of a multi-tile request end
        # where their last row does, which no refresh rewrites.
        try:  # a tvm-ffi Array of int64 in FlashInfer 0.7.2
            info = [int(v) for v in plan_info]
        except (TypeError, ValueError):
            return None
        if len(info) != len(PLAN_INFO_FIELDS):
            return None
        at = dict(zip(PLAN_INFO_FIELDS, info))
        cluster_size, num_clusters = at["num_blks_x"], at["num_blks_y"]
        if any(at[f] % 4 for f in PLAN_INFO_FIELDS[2:16]) or num_clusters <= 0:
            return None
        # Plain Python lists, not numpy: a decode plan has tens of work items, where one numpy
        # call (~2-5 us) costs more than a list pass over them, and this runs after every real
        # plan (0.29-0.49 ms of a native re-plan's host time on the H200 as numpy code, twelfth
        # and thirteenth sessions). One tolist() read of the int scratch per field.
        ws = pinned_ws.view(torch.int32).numpy()

        def array(field: str, n: int) -> list[int]:
            start = at[field] // 4
            return ws[start:start + n].tolist()

        work_indptr = array("work_indptr", num_clusters + 1)
        num_works = work_indptr[-1]
        # (list comparisons and map() run in C: no per-element Python code for the checks)
        if (len(work_indptr) != num_clusters + 1 or work_indptr[0] != 0 or num_works <= 0
                or work_indptr != sorted(work_indptr)):
            return None
        q_start_w, kv_start_w = array("q_start", num_works), array("kv_start", num_works)
        kv_end_w, q_w = array("kv_end", num_works), array("q_indptr", num_works)
        kv_len_w = array("kv_len", num_works)
        if len(kv_len_w) != num_works:
            return None
        qo, kv = qo_indptr.tolist(), kv_lens.tolist()
        num_req = len(kv)
        q_lens = [b - a for a, b in zip(qo, qo[1:])]
        num_real = sum(1 for q in q_lens if q > 0)
        # plan_hopper_decode puts real requests first, padding requests (no rows, no KV) after
        if (num_real == 0 or min(q_lens[:num_real]) <= 0 or any(kv[num_real:])
                or len(q_lens) != num_req):
            return None
        if max(q_lens) * num_heads > cluster_size * _CTA_TILE_Q or any(q_start_w):
            return None  # a request spanning several query tiles: chunk ends differ per tile
        # the real requests' query starts are distinct (each has rows): a work's request is
        # the one its q_indptr starts; the rest must be empty works of the padding request
        request_of = {qo[i]: i for i in range(num_real)}
        req = [request_of.get(q, -1) for q in q_w]
        if -1 in req:
            if num_real == num_req:
                return None
            pad_q = qo[num_real]
            for j, r in enumerate(req):
                if r == -1:
                    if kv_len_w[j] or kv_end_w[j] or q_w[j] != pad_q:
                        return None
                    req[j] = num_real
        kv_ext = kv + [0]  # padding works point at request num_real (length 0)
        if kv_len_w != list(map(kv_ext.__getitem__, req)):
            return None
        # (every request is one query tile here, so MLAPlan's tile-weighted total is sum(kv))
        limit = limit_of_total(sum(kv), num_clusters)
        # every real request's chunks must tile [0, kv) in pieces of at most `limit`
        counts = [0] * (num_real + 1)
        for r in req:
            counts[r] += 1
        counts = counts[:num_real]
        if counts != [chunk_count(k, limit) for k in kv[:num_real]]:
            return None
        # works ordered by (request, kv_start), ties by position (as a stable lexsort)
        order = sorted(range(num_works), key=list(zip(req, kv_start_w)).__getitem__)
        last_work, last_req = [], []
        previous = -1
        for n, j in enumerate(order):
            r, s, e = req[j], kv_start_w[j], kv_end_w[j]
            if e - s > limit or e < s:
                return None
            if r != previous:
                if s != 0:
                    return None  # a request's first chunk starts its KV
            elif s != kv_end_w[order[n - 1]]:
                return None  # chunks of one request are contiguous
            if r < num_real and (n + 1 == num_works or req[order[n + 1]] != r):
                if e != kv[r]:
                    return None  # its last chunk ends its KV
                last_work.append(j)
                last_req.append(r)
            previous = r
        return cls.of_works(qo_indptr, num_real, req, last_work, last_req, kv_end_w, counts,
                            limit, info, num_heads, causal, draft,
                            padding_works=req.count(num_real))

    @classmethod
    def of_works(cls, qo_indptr: np.ndarray, num_real: int, work_req: list, last_work: list,
                 last_req: list, kv_end: list, counts: list, limit: int, info, num_heads: int,
                 causal: bool, draft: bool, padding_works: int = 0) -> "PlanSkeleton":
        """The skeleton of a plan of the recognised form from its works (each work's request,
        the works ending a request's KV with their requests, every kv_end), the real requests'
        chunk counts and the plan's limit and plan_info: from_plan's read-back and a plan
        written on the host (flashinfer_host_plan.skeleton_of) both end here."""
        slack = refresh_slack(limit, draft)
        int64 = np.int64
        at = dict(zip(PLAN_INFO_FIELDS, info))
        return cls(qo_indptr=qo_indptr.astype(int64), num_real=num_real,
                   lo=np.array([(c - 1) * limit if c > 1 else -1 for c in counts], dtype=int64),
                   # (the last chunk may outgrow the limit by the slack)
                   hi=np.array([c * limit + slack for c in counts], dtype=int64),
                   qo_bytes=qo_indptr.tobytes(), qo_dtype=qo_indptr.dtype,
                   ends_are_lengths=len(last_work) == len(work_req) - padding_works,
                   work_req=np.array(work_req, dtype=int64),
                   last_work=np.array(last_work, dtype=int64),
                   last_req=np.array(last_req, dtype=int64),
                   kv_end=np.array(kv_end, dtype=int64),
                   offsets={f: at[f] // 4 for f in ("kv_indptr", "kv_len", "kv_end")},
                   num_works=len(work_req), limit=limit, counts=tuple(counts),
                   num_clusters=at["num_blks_y"], info=tuple(info), num_heads=int(num_heads),
                   causal=bool(causal))

    def fits(self, qo_indptr: np.ndarray, kv_lens: np.ndarray) -> bool:
        """Whether (qo_indptr, kv_lens) keep this plan's rows and every chunk count, every last
        chunk within the limit + slack."""
        if qo_indptr.dtype == self.qo_dtype:  # the same rows: the same bytes (one compare)
            if qo_indptr.tobytes() != self.qo_bytes:
                return False
        elif qo_indptr.shape != self.qo_indptr.shape or not np.array_equal(qo_indptr,
                                                                           self.qo_indptr):
            return False
        n = self.num_real
        kv = kv_lens[:n]
        return bool(((kv > self.lo) & (kv <= self.hi)).all() and not kv_lens[n:].any())

    def fill(self, out: np.ndarray, kv_indptr: np.ndarray, kv_lens: np.ndarray) -> None:
        """Write the refreshed (kv_indptr, kv_len, kv_end) work arrays into out[3, >= W]."""
        w = self.num_works
        req = self.work_req  # padding works point at request num_real, itself a padding request
        if kv_indptr.dtype == out.dtype and kv_lens.dtype == out.dtype:
            np.take(kv_indptr, req, out=out[0, :w])  # no temporary
            np.take(kv_lens, req, out=out[1, :w])
        else:
            out[0, :w] = kv_indptr[req]
            out[1, :w] = kv_lens[req]
        if self.ends_are_lengths and not kv_lens[self.num_real:].any():
            # one chunk per request: every work ends its request's KV (padding works: 0 = the
            # padding request's length), so kv_end is the kv_len row
            out[2, :w] = out[1, :w]
        else:
            out[2, :w] = self.kv_end
            out[2, self.last_work] = kv_lens[self.last_req]


class PlanRefresher:
    """Per graph wrapper: the skeleton of its last real plan and the pinned buffers that carry
    refreshed work arrays to its int workspace. Two ways to keep a buffer from being rewritten
    before its non-blocking copy has read it:
      * a caller that stages the step's CSR in a PlanStaging ring passes that set's index
        (`ring_index`): the work arrays then go through a buffer of the same index, guarded by
        the event the staging records for that set after the plan (no event of its own);
      * otherwise an own ring of `depth` buffers, each guarded by an event, as in PlanStaging.
    The buffers are small ([3, max_works] int32), so the own ring is deep enough for a wrapper
    planned several times in one step never to wait on the GPU."""

    def __init__(self, int_workspace: torch.Tensor, max_works: int, depth: int = 8,
                 keep_plans: bool = False):
        self.device_ws = int_workspace.view(torch.int32)
        self.max_works = max_works
        pin = self._cuda = torch.cuda.is_available() and int_workspace.is_cuda
        self._pin = pin
        self._host = [torch.zeros(3, max_works, dtype=torch.int32, pin_memory=pin)
                      for _ in range(depth)]
        self._np = [t.numpy() for t in self._host]
        self._events: list = [None] * depth
        self._next = 0
        # buffers of the staging-ring indices (made on first use), and their [:W] row views
        self._ring_host: dict[int, torch.Tensor] = {}
        self._rows: dict[tuple[int, int], tuple] = {}
        self.skeleton: PlanSkeleton | None = None
        self._views: tuple | None = None
        # bytes of the CSR kv_indptr whose work array the device holds (None: unknown): while
        # no request changes its page count, the work kv_indptr is unchanged and not copied
        self._indptr_written: bytes | None = None
        self.refreshes = 0
        # (lower_on_device's index and the page-list rebuild's work -> request map live in
        # the held skeleton's `device`, made on first use)
        self.device_lowerings = 0
        self.page_list_rebuilds = 0
        # graph plans by chunk structure (flashinfer_plan_cache.py; None: not asked for by
        # the wrapper, or switched off)
        self.cache = _cache.PlanCache() if keep_plans and _cache.plan_cache_enabled() else None
        self.cache_put_backs = 0
        # plans written on the host for structures the cache lacked (flashinfer_host_plan.py)
        self.host_plans = 0
        self.host_plans_enabled = self.cache is not None and _host.host_plans_enabled()
        # the device's SMs, which MLAPlan's cluster count and merge bound come from (without
        # CUDA: the held plan's clusters times their size)
        self.num_sm = 0
        if self._cuda:
            self.num_sm = torch.cuda.get_device_properties(
                int_workspace.device).multi_processor_count
        # why a step was planned for real instead (benchmarks print these)
        self.misses = {"no skeleton": 0, "other rows or chunk counts": 0}

    def adopt(self, skeleton: PlanSkeleton | None) -> None:
        """Keep the skeleton of the plan just made (None: the next step re-plans)."""
        if skeleton is not None and skeleton.num_works > self.max_works:
            skeleton = None
        self.skeleton = skeleton
        self._rows.clear()  # row views are cut to the skeleton's work count
        self._indptr_written = None  # the plan wrote the work kv_indptr itself
        if skeleton is not None:
            w, ws = skeleton.num_works, self.device_ws
            self._views = tuple(ws[skeleton.offsets[f]: skeleton.offsets[f] + w]
                                for f in ("kv_indptr", "kv_len", "kv_end"))

    def keep(self, pinned_ws: torch.Tensor) -> None:
        """After a real plan whose skeleton was just adopted: keep the plan (read from the
        page-locked scratch it was written to) by its chunk structure, for put_back."""
        sk = self.skeleton
        # (not while a CUDA graph is captured: the store's copies would be captured with it)
        if (self.cache is not None and sk is not None
                and not _cache.capturing()):
            self.cache.store(sk, sk.info, pinned_ws, self.device_ws.device)

    def find_kept(self, qo_bytes: bytes, lower: np.ndarray, upper: np.ndarray,
                  draft: bool) -> _cache.CachedPlan | None:
        """A kept plan for the query rows `qo_bytes` (the planned qo_indptr's bytes) valid for
        every length of the real requests between `lower` and `upper` (PlanCache.find), with
        the held plan's offsets; without one, a plan written on the host for them
        (flashinfer_host_plan.py) and kept; None where neither serves. Changes nothing on the
        device."""
        sk = self.skeleton
        if self.cache is None or sk is None or _cache.capturing():
            return None
        entry = None
        if len(self.cache):
            entry = self.cache.find(qo_bytes, lower, upper, sk.num_clusters, draft)
        if entry is None and self.host_plans_enabled:
            entry = self._host_plan(qo_bytes, lower, upper, draft)
        if entry is None or entry.info != sk.info or entry.skeleton is sk:
            return None
        return entry

    def _host_plan(self, qo_bytes: bytes, lower: np.ndarray, upper: np.ndarray,
                   draft: bool) -> _cache.CachedPlan | None:
        """Write MLAPlan's plan for the held plan's rows at the lengths `lower` (a draft plan:
        or `upper`) on the host and keep it, when it serves every length in [lower, upper] as
        PlanCache.find would ask of a kept one; None otherwise."""
        sk = self.skeleton
        n = sk.num_real
        if (qo_bytes != sk.qo_bytes or sk.num_heads <= 0 or lower.shape[0] != n
                or upper.shape[0] != n):
            return None
        same = lower is upper or np.array_equal(lower, upper)
        qo = np.frombuffer(sk.qo_bytes, dtype=sk.qo_dtype)
        num_sm = self.num_sm or sk.info[0] * sk.info[1]
        for lengths in ((lower,) if same or not draft else (lower, upper)):
            kv = np.zeros(qo.shape[0] - 1, dtype=np.int64)
            kv[:n] = lengths
            plan = _host.mla_plan(qo, np.zeros_like(qo), kv, sk.num_heads, num_sm, sk.causal)
            skeleton = None if plan is None else _host.skeleton_of(
                plan, qo, kv, sk.num_heads, sk.causal, sk.info, draft)
            if skeleton is None:
                return None
            if not _cache.serves(skeleton, lower, upper, sk.num_clusters, draft):
                continue  # (a draft range: the upper bound's structure may serve)
            self.host_plans += 1
            return self.cache.store_values(skeleton, sk.info,
                                           _host.workspace_values(plan, sk.info),
                                           self.device_ws.device)
        return None

    def put_back(self, entry: _cache.CachedPlan) -> None:
        """Write a kept plan (find_kept) into the int workspace and hold its skeleton; the
        caller then writes its page lists and lengths (rebuild_page_lists_on_device and
        lower_on_device, or a host refresh), as for any held plan."""
        _cache.PlanCache.put_back(entry, self.device_ws)
        self.adopt(entry.skeleton)
        self.cache_put_backs += 1

    def _buffer(self, ring_index: int | None):
        """(host tensor, key of its row views) of the buffer this refresh writes."""
        if ring_index is not None:
            host = self._ring_host.get(ring_index)
            if host is None:
                host = self._ring_host[ring_index] = torch.zeros(
                    3, self.max_works, dtype=torch.int32, pin_memory=self._pin)
            return host, ("ring", ring_index)
        i = self._next
        self._next = (i + 1) % len(self._host)
        event = self._events[i]
        if event is not None and not event.query():
            event.synchronize()
        return self._host[i], ("own", i)

    def _index_on_device(self) -> tuple:
        """(index, n, m) of the held skeleton: `index` the flat int64 device tensor [kv_len
        positions (n), their requests (n), kv_end positions (m), their requests (m)] of its
        real works in the int32 workspace (plan_lowering.py), one non-blocking copy from
        pinned memory per skeleton: no host sync."""
        sk = self.skeleton
        index = sk.device.get("index")
        if index is None:
            real = np.nonzero(sk.work_req < sk.num_real)[0]
            if sk.ends_are_lengths:  # one chunk per request: every real work ends its KV
                ends, end_req = real, sk.work_req[real]
            else:
                ends, end_req = sk.last_work, sk.last_req
            host = np.concatenate([sk.offsets["kv_len"] + real, sk.work_req[real],
                                   sk.offsets["kv_end"] + ends, end_req]).astype(np.int64)
            flat = upload(host, self.device_ws.device)  # (pinned ring: no cudaHostAlloc)
            index = sk.device["index"] = (flat, len(real), len(ends))
        return index

    def lower_on_device(self, new_lens: torch.Tensor, num_reqs: int | None = None,
                        kv_len_arr: torch.Tensor | None = None) -> None:
        """Write request lengths held on the device (`new_lens`, the held plan's requests in
        order; its first `num_reqs`, default all) into its work arrays with stream-ordered
        device writes: every real work's kv_len and every last work's kv_end, what `fill`
        writes for them (kv_indptr and the padding works keep their values), and, given
        `kv_len_arr`, kv_len_arr[:num_reqs] too. For a plan made from host upper bounds whose
        exact lengths only the device has yet (the early draft step, early_draft.py). The
        caller has checked on the host that the skeleton fits every length the device may
        hold (`fits` of the lowest and of the planned ones). On CUDA one Triton launch
        (plan_lowering.py), else torch ops."""
        num_reqs = new_lens.shape[0] if num_reqs is None else int(num_reqs)
        self.lowering(num_reqs, kv_len_arr).launch(new_lens)

    def lowering(self, num_reqs: int, kv_len_arr: torch.Tensor | None) -> PlanLowering:
        """lower_on_device's writes (plan_lowering.PlanLowering), counted as one lowering:
        launched on their own, or performed by the launch that writes the lengths (a block
        drafter's input write). Same preconditions."""
        if self.skeleton is None:
            raise RuntimeError("lowering a plan needs a held plan skeleton")
        index, n, m = self._index_on_device()
        self.device_lowerings += 1
        return PlanLowering(self.device_ws, index, n, m, kv_len_arr, int(num_reqs))

    def rebuild_page_lists_on_device(self, table: torch.Tensor, lens: torch.Tensor,
                                     num_reqs: int, num_planned: int, kv_indptr: torch.Tensor,
                                     kv_indices: torch.Tensor, page_size: int,
                                     max_requests: int | None = None,
                                     lookahead: int = 0) -> None:
        """Write the held plan's page lists for the device lengths `lens` (its first num_reqs
        requests, rows of `table`): the CSR kv_indptr / kv_indices and every work's kv_indptr
        in the int workspace (plan_lowering.py). The chunks stay; `lower_on_device` then writes
        the lengths. The caller has checked that the skeleton fits those lengths and that
        their pages fit the buffers. `lookahead` tokens: each request lists the pages of its
        length plus that many (pages its row holds; plan_lowering.py)."""
        if self.skeleton is None:
            raise RuntimeError("rebuild_page_lists_on_device needs a held plan skeleton")
        work_req = self.skeleton.device.get("work_req")
        if work_req is None:
            work_req = self.skeleton.device["work_req"] = upload(
                self.skeleton.work_req.astype(np.int64), self.device_ws.device)
        ws = self.device_ws
        rebuild = (rebuild_csr_triton if ws.is_cuda and HAS_TRITON and table.is_cuda
                   else rebuild_csr_torch)
        rebuild(table, lens, num_reqs, num_planned, kv_indptr, kv_indices, ws,
                self.skeleton.offsets["kv_indptr"], work_req, page_size,
                max_requests=max_requests, lookahead=lookahead)
        self._indptr_written = None  # the work kv_indptr is the device's now
        self.page_list_rebuilds += 1

    def try_refresh(self, qo_indptr: np.ndarray, kv_indptr: np.ndarray,
                    kv_lens: np.ndarray, ring_index: int | None = None) -> bool:
        """Refresh the held plan for new lengths (True), or leave it (False: plan afresh)."""
        sk = self.skeleton
        if sk is None:
            self.misses["no skeleton"] += 1
            return False
        if not sk.fits(qo_indptr, kv_lens):
            self.misses["other rows or chunk counts"] += 1
            return False
        host, key = self._buffer(ring_index)
        rows = self._rows.get(key)
        if rows is None:  # [:W] views made once per skeleton (a torch slice costs ~1.5 us)
            w = sk.num_works
            rows = self._rows[key] = (host.numpy(), host[0, :w], host[1, :w], host[2, :w])
        sk.fill(rows[0], kv_indptr, kv_lens)
        indptr = kv_indptr.tobytes()
        views = self._views
        if indptr != self._indptr_written:
            views[0].copy_(rows[1], non_blocking=True)
            self._indptr_written = indptr
        views[1].copy_(rows[2], non_blocking=True)
        views[2].copy_(rows[3], non_blocking=True)
        if ring_index is None and self._cuda:
            i = key[1]
            event = self._events[i]
            if event is None:
                event = self._events[i] = torch.cuda.Event()
            record_event(event)
        self.refreshes += 1
        return True
