"""FLASHINFER_MLA: FlashInfer 0.7.2 MLA decode kernels (DESIGN §5).

Hopper (sm90): `flashinfer.mla.BatchMLAPagedAttentionWrapper(backend="fa3")`.
  * non-causal DSpark/DFlash blocks and single-token rows run FUSED: one request
    per block, qo_len = Q, kv_len = local(G), causal=False;
  * causal multi-token rows under DCP cannot use causal=True on local keys
    (DESIGN §2). "runs" (default) splits each block into runs of consecutive rows
    with the same visible local count c_j and plans every run as a non-causal
    request over the same pages; "flattened" plans every row on its own (the
    slow baseline and the oracle for "runs"). At DCP=1 "auto" uses causal=True.
  * the plan is made once per step (first layer that runs) and reused by every
    layer of the group; LSE comes back natural-log either via lse_mode="basee"
    or as base 2 converted once here (`natural_lse` flag). On CUDA-graph
    wrappers a step whose lengths only grew within each request's chunks
    refreshes the held plan instead (flashinfer_plan_refresh.py).
Blackwell (sm100): `flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla`
  with the kernel's native DCP arguments (cute-dsl, interleave 1, natural-log LSE).

flashinfer is imported lazily (`_import_flashinfer`) so this module imports on
machines without it; CPU tests replace that function with recording fakes.
"""
from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from vllm.utils.cuda_streams import record_event
from vllm.utils.env_flags import switch_flag
from vllm.v1.attention.backend import AttentionBackend, CommonAttentionMetadata
from vllm.v1.attention.backends.mla.common import (MLACommonDecodeMetadata, MLACommonImpl,
                                                    MLACommonMetadata,
                                                    MLACommonMetadataBuilder, MLADecodeKind,
                                                    uniform_query_block)
from vllm.v1.attention.backends.mla.flashinfer_plan_cache import (capturing,
                                                                  single_request_lengths,
                                                                  structure_of)
from vllm.v1.attention.backends.mla.flashinfer_plan_refresh import PlanRefresher, PlanSkeleton
from vllm.v1.attention.backends.mla.plan_lowering import FusedDraftLowering
from vllm.v1.attention.ops.dcp_combine import LN2

logger = logging.getLogger(__name__)

DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024
BLACKWELL_BLOCK_SIZES = (32, 64)
_FA3_DTYPES = (torch.bfloat16, torch.float16)  # what the kernels accept (float fakes widen it)


# Held graph plans whose requests grew into pages they do not list get their page lists
# rebuilt on the device (_rebuild_page_lists) instead of a host build. On by default since its
# GPU tests passed (twenty-sixth session, one H100); "0" builds such steps on the host.
PAGE_LIST_REBUILD_FLAG = "VLLM_PLAN_PAGE_LIST_REBUILD"


def page_list_rebuild_enabled() -> bool:
    return switch_flag(PAGE_LIST_REBUILD_FLAG, True,
                       "rebuild a held plan's page lists on the device when its requests grew "
                       "into pages it does not list", "build such steps on the host")


# A device rebuild of the page lists also lists the pages each row already holds past the
# upper bound of its length (up to the fewest any row holds ahead: `lookahead` tokens,
# plan_lowering.py), so the next advances that grow into them find them listed. Without it a
# speculative step rebuilt in 0.65 of its steps against 0.07 of a plain step's (B=1 DSpark,
# thirtieth session's probe, one H100): a verify step's upper bound grows by up to 1 + k
# tokens and its lower bound trails it by k, so most steps cross a page the rebuild did not
# list. "0" lists each length's own pages only, as a host plan does.
PAGE_LIST_LOOKAHEAD_FLAG = "VLLM_PLAN_PAGE_LIST_LOOKAHEAD"


def page_list_lookahead_enabled() -> bool:
    return switch_flag(PAGE_LIST_LOOKAHEAD_FLAG, True,
                       "list the pages rows already hold ahead of their lengths when page "
                       "lists are rebuilt on the device", "list each length's own pages only")


KernelFamily = Literal["hopper", "blackwell"]
CausalPlanMode = Literal["auto", "runs", "flattened"]


def _import_flashinfer():
    """Return the flashinfer package with .mla and .decode loaded (patched in CPU tests)."""
    import flashinfer
    import flashinfer.decode  # noqa: F401
    import flashinfer.mla  # noqa: F401
    return flashinfer


def detect_kernel_family(device: torch.device) -> KernelFamily:
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"FLASHINFER_MLA needs a CUDA device, got {device}; use "
                         f"attention_backend=TORCH_MLA on this device.")
    major, minor = torch.cuda.get_device_capability(device)
    if major == 9:
        return "hopper"
    if major == 10:
        return "blackwell"
    raise ValueError(f"FLASHINFER_MLA supports sm90 (Hopper) and sm100 (Blackwell), got "
                     f"sm{major}{minor}; use attention_backend=TORCH_MLA.")


# ------------------------------------------------------------ Hopper planning
@dataclass
class HopperPlanInputs:
    """Host-side CSR description of one step's decode rows as FlashInfer requests."""

    qo_indptr: torch.Tensor   # [R+1] int32
    kv_indptr: torch.Tensor   # [R+1] int32 (pages)
    kv_indices: torch.Tensor  # [total pages] int32
    kv_len_arr: torch.Tensor  # [R] int32 (tokens)
    causal: bool
    has_empty_rows: bool = False  # some row sees no token on this rank
    # Graph plans staged in a PlanStaging set: the four arrays are consecutive in ONE host
    # buffer ([qo | kv_indptr | kv_len | kv_indices], `packed_layout` = (R, max_pages)), and
    # `packed` is its used prefix, so a graph wrapper of the same layout takes them in one copy.
    packed: torch.Tensor | None = None
    packed_layout: tuple[int, int] | None = None
    # Staged plans: (the PlanStaging ring, the index of the set holding these arrays), and
    # numpy views of qo_indptr, kv_indptr, kv_len_arr (the refresh reads them every step).
    staged_in: tuple | None = None
    arrays: tuple | None = None
    # Fused layouts (one request per live block): the decode request of each planned request
    # (refresh_decode_seq_lens maps new per-request lengths through it).
    request_rows: np.ndarray | None = None
    # The device page lists were rebuilt from the device block table since these host arrays
    # were planned (_lower_held_plan): kv_indptr / kv_indices here no longer say what the
    # device lists (host refreshes in place are refused); later advances compare against
    # `rebuilt_lists` instead.
    host_csr_stale: bool = False
    # After such a rebuild: (the pages each request surely lists [n], those of the lowest
    # length the device may have held, and the host twin of the block table rows [n, w] the
    # lists were cut from). A later advance whose pages lie within them and whose rows still
    # hold those pages needs no rebuild (without it every advance after the first page
    # crossing rebuilt: 32 of 60 plain B=1 steps, twenty-sixth session's profile).
    rebuilt_lists: tuple[np.ndarray, np.ndarray] | None = None
    # Per plan, made on the first advance (_page_check): whether the planned requests are the
    # batch's first rows in order, and (table width, flat table positions of every listed page,
    # the listed page ids, pages per request) for the page comparison. The plan's CSR does not
    # change while it is its slot's latest, so each advance reuses them (~9 of the ~17 us of
    # an advance's host checks on the CPU box, re-derived every step before).
    rows_first: bool | None = None
    page_check: tuple | None = None

    @property
    def num_requests(self) -> int:
        return self.kv_len_arr.numel()


def _segments_of_block(row_lens: list[int], mode: str) -> list[tuple[int, int]]:
    """Split one causal block's rows into (num_rows, kv_len) planned requests."""
    if mode == "flattened":
        return [(1, n) for n in row_lens]
    segments: list[tuple[int, int]] = []
    for n in row_lens:  # runs of consecutive rows with the same visible count
        if segments and segments[-1][1] == n:
            segments[-1] = (segments[-1][0] + 1, n)
        else:
            segments.append((1, n))
    return segments


def _host(twin: torch.Tensor | None, device_tensor: torch.Tensor, name: str) -> torch.Tensor:
    if twin is not None:
        return twin
    if device_tensor.device.type == "cpu":
        return device_tensor
    raise ValueError(f"FlashInfer planning needs the host twin of {name} (the runner passes it); "
                     "reading the device tensor back would sync every step.")


def max_plan_requests(num_rows: int, q_len: int, dcp_size: int) -> int:
    """Upper bound of planned requests for num_rows blocks of q_len rows: a causal block under DCP
    splits into at most ceil(Q/N) + 1 runs of equal visible counts (DESIGN §5)."""
    if dcp_size == 1 or q_len <= 1:
        return num_rows
    return num_rows * min(q_len, -(-q_len // dcp_size) + 1)


class PlanStaging:
    """Pinned host buffers the CSR plan inputs are written into (no per-step allocation).

    FlashInfer copies them to the device with non-blocking copies, so a buffer may not be
    rewritten before the GPU has read it: a ring of `depth` buffer sets, each guarded by an event
    recorded after its plan. A set comes round again only `depth` plans later, long after the
    step-end synchronisation, so `acquire` normally finds the event complete and never blocks."""

    def __init__(self, max_requests: int, max_pages: int, depth: int = 8):
        self.max_requests, self.max_pages = max_requests, max_pages
        # asked once: torch.cuda.is_available() costs microseconds per call, every plan
        pin = self._cuda = torch.cuda.is_available()
        self._sets, self._flat = [], []
        for _ in range(depth):
            # one buffer per set, laid out as packed_csr_views: a graph plan then moves the
            # whole CSR in one copy (_native_replan)
            flat = torch.zeros(packed_csr_size(max_requests, max_pages), dtype=torch.int32,
                               pin_memory=pin)
            self._flat.append(flat)
            self._sets.append(packed_csr_views(flat, max_requests))
        # numpy views of every set, made once (a .numpy() call per array per step adds up)
        self._np_sets = [tuple(t.numpy() for t in tensors) for tensors in self._sets]
        self._events: list = [None] * depth
        self._next = 0
        self._current = 0
        self.fused_layout = None  # the last _FusedLayout planned through this ring
        # per set: (serial of the fused layout, request count) its qo/padding entries were
        # written for (plan_hopper_decode then writes only the lengths)
        self._holding: list = [None] * depth

    @property
    def layout(self) -> tuple[int, int]:
        return self.max_requests, self.max_pages

    def holds(self, layout, total: int) -> bool:
        """Whether the current set was last written for this layout and request count."""
        return self._holding[self._current] == (layout.serial, total)

    def mark_holding(self, layout, total: int) -> None:
        self._holding[self._current] = None if layout is None else (layout.serial, total)

    @property
    def current_index(self) -> int:
        """The set the last `acquire` handed out (guarded by the next consumed-mark)."""
        return self._current

    def packed_prefix(self, num_pages: int) -> torch.Tensor:
        """The current set's [qo | kv_indptr | kv_len | first num_pages kv_indices] prefix."""
        return self._flat[self._current][: packed_csr_size(self.max_requests, num_pages)]

    def fits(self, num_requests: int, num_pages: int) -> bool:
        return num_requests <= self.max_requests and num_pages <= self.max_pages

    def acquire(self):
        """The next buffer set (waits only if the GPU has not consumed it yet)."""
        i = self._next
        self._next = (i + 1) % len(self._sets)
        event = self._events[i]
        if event is not None and not event.query():
            event.synchronize()
        self._current = i
        return self._sets[i]

    def acquire_views(self, num_requests: int, num_pages: int):
        """acquire(), cut to one plan: ((qo, kv_indptr, kv_len, kv_indices) tensors, the same as
        numpy arrays). A graph plan uses the full request range: no cut is made there."""
        tensors = self.acquire()
        arrays = self._np_sets[self._current]
        if num_requests != self.max_requests:
            r1 = num_requests + 1
            tensors = (tensors[0][:r1], tensors[1][:r1], tensors[2][:num_requests], tensors[3])
            arrays = (arrays[0][:r1], arrays[1][:r1], arrays[2][:num_requests], arrays[3])
        return ((*tensors[:3], tensors[3][:num_pages]), (*arrays[:3], arrays[3][:num_pages]))

    def mark_consumed_after_this_point(self) -> None:
        """Record, on the current stream, the point after which the last set is free again."""
        if self._cuda:
            event = self._events[self._current]
            if event is None:
                event = self._events[self._current] = torch.cuda.Event()
            record_event(event)


def packed_csr_size(num_requests: int, num_pages: int) -> int:
    return 3 * num_requests + 2 + num_pages


def packed_csr_views(flat: torch.Tensor, num_requests: int):
    """(qo_indptr [R+1], kv_indptr [R+1], kv_len_arr [R], kv_indices [rest]) as consecutive,
    non-overlapping views of one int32 buffer (FlashInfer accepts such graph buffers)."""
    r1 = num_requests + 1
    return (flat[:r1], flat[r1:2 * r1], flat[2 * r1:2 * r1 + num_requests],
            flat[2 * r1 + num_requests:])


def _request_segments(bounds, row_lens, causal_mode: str):
    """(request index, query rows, kv_len) of every planned request of causal blocks split
    into runs (or single rows), as numpy arrays. Fused plans (one request per block, every row
    seeing rows[-1] for non-causal / Q=1 blocks, or the kernel's causal bottom-right alignment
    at DCP 1) take _FusedLayout instead."""
    starts, ends = bounds[:-1], bounds[1:]
    live = np.nonzero(ends > starts)[0]
    reqs, nrows, kvs = [], [], []
    for req in live.tolist():
        for num_rows, kv_len in _segments_of_block(
                row_lens[starts[req]:ends[req]].tolist(),
                "flattened" if causal_mode == "flattened" else "runs"):
            reqs.append(req)
            nrows.append(num_rows)
            kvs.append(kv_len)
    return (np.asarray(reqs, dtype=np.int64), np.asarray(nrows, dtype=np.int64),
            np.asarray(kvs, dtype=np.int64))


_LAYOUT_SERIALS = itertools.count()


@dataclass
class _FusedLayout:
    """What a fused plan (one request per live block) takes from the query rows alone: the
    same every steady decode step, so PlanStaging keeps the last one (`fused_layout`)."""

    key: tuple            # (dtype, bytes) of the query_start_loc it was made from
    reqs: np.ndarray      # [n] int64 live block of each planned request
    last_rows: np.ndarray  # [n] int64 the row whose visible count is the request's kv_len
    qo: np.ndarray        # [n+1] int32 qo_indptr of the real requests
    plain: bool = False   # last_rows == arange(n): the lengths are a prefix of the rows
    # [n] int64 first element of each request's block-table row in the flattened table
    # (made per table stride, see `table_starts`)
    stride: int = -1
    row_starts: np.ndarray | None = None
    serial: int = field(default_factory=lambda: next(_LAYOUT_SERIALS))  # never reused

    @classmethod
    def of(cls, bounds: np.ndarray, key: tuple) -> "_FusedLayout":
        b = bounds.astype(np.int64)
        starts, ends = b[:-1], b[1:]
        live = np.nonzero(ends > starts)[0]
        qo = np.zeros(len(live) + 1, dtype=np.int32)
        np.cumsum(ends[live] - starts[live], out=qo[1:], dtype=np.int32)
        last_rows = ends[live] - 1
        n = len(live)
        plain = bool(n) and int(last_rows[-1]) == n - 1  # increasing: then rows 0..n-1
        return cls(key=key, reqs=live, last_rows=last_rows, qo=qo, plain=plain)

    def table_starts(self, stride: int) -> np.ndarray:
        if stride != self.stride:
            self.stride, self.row_starts = stride, self.reqs * stride
        return self.row_starts


def _fused_layout(bounds: np.ndarray, staging: "PlanStaging | None") -> _FusedLayout:
    key = (bounds.dtype.char, bounds.tobytes())
    held = None if staging is None else staging.fused_layout
    if held is not None and held.key == key:
        return held
    layout = _FusedLayout.of(bounds, key)
    if staging is not None:
        staging.fused_layout = layout
    return layout


def _gather_pages(block_table: np.ndarray, layout: _FusedLayout, kv_indptr: np.ndarray,
                  pages: np.ndarray, num_pages: int, out: np.ndarray) -> None:
    """out[kv_indptr[i] + p] = block_table[reqs[i], p] for p < pages[i] (one take)."""
    n = len(pages)
    if not block_table.flags.c_contiguous:
        block_table = np.ascontiguousarray(block_table)
    if n and int(pages.max()) > block_table.shape[1]:
        raise ValueError(f"a request needs {int(pages.max())} pages but the block table has "
                         f"{block_table.shape[1]} columns; the runner's block table is too narrow "
                         "for these sequence lengths.")
    # element p of request i sits at flat index row_start[i] + p = (row_start[i] - indptr[i])
    # + (indptr[i] + p): a per-request shift repeated over its pages, plus the running index
    shift = layout.table_starts(block_table.shape[1]) - kv_indptr[:n]
    idx = np.repeat(shift, pages)
    idx += _arange(num_pages)
    block_table.reshape(-1).take(idx, out=out)


_ARANGE = np.arange(4096, dtype=np.int64)


def _page_check(inputs: HopperPlanInputs, n: int, width: int) -> tuple:
    """(flat positions in a block table `width` wide of every page the plan lists, the listed
    page ids, pages per request) for the plan's first n requests, rows 0..n-1 of the table;
    made once per plan (HopperPlanInputs.page_check)."""
    cached = inputs.page_check
    if cached is None or cached[0] != width:
        kv_indptr = inputs.arrays[1]
        counts = (kv_indptr[1:n + 1] - kv_indptr[:n]).astype(np.int64)
        num_pages = int(kv_indptr[n])
        where = np.repeat(_arange(n) * width - kv_indptr[:n].astype(np.int64), counts)
        where += _arange(num_pages)
        cached = inputs.page_check = (width, where, inputs.kv_indices.numpy()[:num_pages],
                                      counts)
    return cached[1:]


def _arange(n: int) -> np.ndarray:
    """np.arange(n) as a view of one held array (an arange per step costs a call and a buffer)."""
    global _ARANGE
    if n > _ARANGE.shape[0]:
        _ARANGE = np.arange(max(n, 2 * _ARANGE.shape[0]), dtype=np.int64)
    return _ARANGE[:n]


def plan_hopper_decode(decode: MLACommonDecodeMetadata, page_size: int,
                       causal_mode: CausalPlanMode = "auto",
                       num_requests: int | None = None,
                       staging: PlanStaging | None = None) -> HopperPlanInputs | None:
    """Turn the decode rows into FlashInfer CSR requests (None when there is no row).
    `num_requests` (CUDA-graph plans) pads the request list with empty requests (no query row,
    no KV) to that fixed count: a graph-mode wrapper's batch size cannot change. With `staging`
    the CSR arrays are written into its pinned buffers (numpy, no allocation); without, fresh
    host tensors are returned (CPU tests, oversized batches)."""
    if causal_mode not in ("auto", "runs", "flattened"):
        raise ValueError(f"causal_mode={causal_mode!r}; choose 'auto', 'runs' or 'flattened'.")
    # Host twins only: plan() runs on the host every step and must not sync on device data.
    bounds = decode.query_start_loc_cpu.numpy()
    row_lens = _host(decode.row_seq_lens_cpu, decode.row_seq_lens, "row_seq_lens").numpy()
    block_table = _host(decode.block_table_cpu, decode.block_table, "block_table").numpy()
    multi_token = decode.kind == MLADecodeKind.CAUSAL_MULTI
    plan_causal = multi_token and causal_mode == "auto" and decode.dcp_world_size == 1
    layout = None
    if not multi_token or plan_causal:
        # One request per live block: its rows and order follow from the query rows alone,
        # kept across steps (steady decode never changes them), so a step only reads lengths.
        layout = _fused_layout(bounds, staging)
        reqs = layout.reqs
        kvs = row_lens[: len(reqs)] if layout.plain else row_lens[layout.last_rows]
    else:
        reqs, nrows, kvs = _request_segments(bounds.astype(np.int64), row_lens.astype(np.int64),
                                             causal_mode)
    if len(kvs) == 0 and num_requests is None:
        return None
    total = len(kvs) if num_requests is None else num_requests
    if len(kvs) > total:
        raise ValueError(f"{len(kvs)} planned requests exceed the graph plan's {num_requests}")
    pages = kvs + (page_size - 1)
    pages //= page_size
    num_pages = int(pages.sum())
    staged = staging is not None and staging.fits(total, num_pages)
    if staged:
        (qo_t, kv_indptr_t, kv_len_t, kv_indices_t), (qo, kv_indptr, kv_len, kv_indices) = \
            staging.acquire_views(total, num_pages)
    else:  # pinned on CUDA hosts: FlashInfer's non-blocking staging copies then never sync
        pin = torch.cuda.is_available()
        qo_t = torch.zeros(total + 1, dtype=torch.int32, pin_memory=pin)
        kv_indptr_t = torch.zeros(total + 1, dtype=torch.int32, pin_memory=pin)
        kv_len_t = torch.zeros(total, dtype=torch.int32, pin_memory=pin)
        kv_indices_t = torch.zeros(num_pages, dtype=torch.int32, pin_memory=pin)
        qo, kv_indptr, kv_len = qo_t.numpy(), kv_indptr_t.numpy(), kv_len_t.numpy()
        kv_indices = kv_indices_t.numpy()
    n = len(kvs)
    # A staged set that last held this very layout (and request count) still holds its qo,
    # the padding requests' zero lengths and kv_indptr[0]: only the lengths are written.
    held = staged and layout is not None and staging.holds(layout, total)
    if not held:
        if layout is not None:
            qo[: n + 1] = layout.qo
        else:
            qo[0] = 0
            if n:
                np.cumsum(nrows, out=qo[1: n + 1], dtype=np.int32)
        qo[n + 1:] = qo[n]  # padding requests: no query row, no KV
        kv_indptr[0] = 0
        kv_len[n:] = 0
        if staged:
            staging.mark_holding(layout, total)
    if n:
        np.cumsum(pages, out=kv_indptr[1: n + 1], dtype=np.int32)
    kv_indptr[n + 1:] = kv_indptr[n]
    kv_len[:n] = kvs
    if num_pages:
        if layout is not None:
            _gather_pages(block_table, layout, kv_indptr, pages, num_pages, kv_indices)
        else:
            width = int(pages.max())
            mask = np.arange(width)[None, :] < pages[:, None]
            kv_indices[:] = block_table[reqs, :width][mask]
    has_empty = total > n or n == 0 or int(kvs.min()) == 0
    packed = packed_layout = None
    if staged and total == staging.max_requests:
        packed, packed_layout = staging.packed_prefix(num_pages), staging.layout
    return HopperPlanInputs(qo_indptr=qo_t, kv_indptr=kv_indptr_t, kv_indices=kv_indices_t,
                            kv_len_arr=kv_len_t, causal=plan_causal, has_empty_rows=has_empty,
                            packed=packed, packed_layout=packed_layout,
                            staged_in=(staging, staging.current_index) if staged else None,
                            arrays=(qo, kv_indptr, kv_len),
                            request_rows=None if layout is None else layout.reqs)


@dataclass
class _WrapperSlot:
    """The builder's one wrapper and the key of the plan it currently holds."""

    wrapper: Any
    planned_for: tuple | None = None
    # Layer-side plan arguments (heads, scale, dtypes, ...) recorded by the first plan; CUDA-graph
    # replays plan at build time from them, since no layer code runs during a replay.
    plan_args: dict | None = None
    staging: PlanStaging | None = None  # pinned CSR buffers of this wrapper's plans
    native_replans: int = 0  # plans that went through FlashInfer's native planner only
    full_plans: int = 0
    # Graph wrappers: their four metadata buffers are views of this one device buffer, laid
    # out like the staging sets (packed_csr_views, `packed_layout` = (R, max_pages)).
    packed_device: torch.Tensor | None = None
    packed_layout: tuple[int, int] | None = None
    # Graph wrappers: the last real plan's skeleton, refreshed for new lengths in place of a
    # re-plan while every request keeps its chunk count (flashinfer_plan_refresh.py).
    refresher: PlanRefresher | None = None
    # A block drafter's draft-block wrapper: its refreshes take the draft slack
    # (flashinfer_plan_refresh.refresh_slack), since no output token depends on its split.
    draft: bool = False
    # Graph wrappers: the longest KV a request may have (the model's length; DCP 1), up to
    # which a one-request layout's chunk structures are planned ahead (_plan_lone_request)
    max_kv_len: int = 0
    # Graph wrappers at DCP 1: keep real plans by chunk structure (flashinfer_plan_cache.py;
    # DCP > 1 keeps none: its put-backs have not run on two GPUs)
    keeps_plans: bool = False

    @property
    def refreshes(self) -> int:
        return 0 if self.refresher is None else self.refresher.refreshes

    @property
    def host_plans(self) -> int:
        """Plans written on the host for a chunk structure (flashinfer_host_plan.py)."""
        return 0 if self.refresher is None else self.refresher.host_plans


def _fa_common_module():
    """flashinfer.mla._batch_mla._backends._fa_common (raises ImportError without it). Looked up
    in sys.modules first: a from-import statement costs microseconds on every re-plan."""
    import sys
    module = sys.modules.get("flashinfer.mla._batch_mla._backends._fa_common")
    if module is None:
        from flashinfer.mla._batch_mla._backends import _fa_common as module
    return module


def _native_replan(slot: _WrapperSlot, inputs: HopperPlanInputs, plan_args: dict) -> bool:
    """Re-plan a fa3 wrapper that holds a plan made with the same layer arguments, through the
    planner FlashInfer's own plan() ends in (`plan_with_staged_workspace_bytes` of the JIT
    module), skipping its Python layers. Those layers validate the (unchanged) layer arguments,
    build a new backend object, allocate an 8 MiB pinned workspace and clone the 8 MiB integer
    workspace for a rollback on every call: ~1.2 ms of host time per step on an H200 node
    (scripts/probe_decode_step.py). The native planner behind it, called through FlashInfer's
    plan_with_staged_workspace_bytes, still takes 2.2-3.4 ms (scripts/probe_replan.py, twelfth
    session, one node; 0.61 ms on the thirteenth session's node, 0.38 ms without that staging:
    _plan_and_stage, the default). FlashInfer's workload check (work-item capacity, the causal
    tile bound) runs unless a bound shows it cannot fail (_workload_surely_fits). Any FlashInfer
    layout this does not recognise returns False and the caller makes a full plan."""
    backend = getattr(slot.wrapper, "_planned_backend", None)
    module = getattr(backend, "_cached_module", None)
    native = getattr(module, "plan_with_staged_workspace_bytes", None)
    if native is None or slot.plan_args != plan_args or getattr(backend, "_backend", None) != "fa3":
        return False
    if getattr(backend, "_causal", None) != inputs.causal:
        return False
    try:
        _fa_common = _fa_common_module()
    except ImportError:
        return False
    graph = bool(getattr(backend, "_use_cuda_graph", False))
    buffers = (backend._qo_indptr_buf, backend._kv_indptr_buf, backend._kv_indices_buf,
               backend._kv_len_arr_buf)
    if graph and (buffers[0].shape[0] != inputs.qo_indptr.shape[0]
                  or buffers[3].shape[0] != inputs.kv_len_arr.shape[0]
                  or buffers[2].shape[0] < inputs.kv_indices.shape[0]):
        return False
    if not _workload_surely_fits(inputs, plan_args["num_heads"], backend.device):
        _fa_common._validate_fa_plan_workload(
            inputs.qo_indptr, inputs.kv_len_arr, plan_args["num_heads"], inputs.causal,
            backend.device, "fa3", plan_args["kv_data_type"])
    args = (backend._float_workspace_buffer, backend._int_workspace_buffer,
            backend._pin_memory_int_workspace_buffer, inputs.qo_indptr, inputs.kv_indptr,
            inputs.kv_len_arr, plan_args["num_heads"], plan_args["head_dim_ckv"], inputs.causal)
    raw_plan = getattr(getattr(module, "_module", None), "plan", None)
    if (raw_plan is not None and own_plan_copy_enabled()
            and not torch.cuda.is_current_stream_capturing()):
        plan_info, staged = _plan_and_stage(raw_plan, args)
    else:
        plan_info, staged = native(*args)
    _upload_csr(slot, backend, inputs, graph)
    backend._plan_info = plan_info
    backend._staged_int_workspace_bytes = staged
    slot.wrapper._plan_info = plan_info
    return True


# FlashInfer 0.7.2's native capacity of one MLA plan (_fa_common._FA_MAX_WORK_ITEMS).
_FA_MAX_WORK_ITEMS = 16384
_SM_COUNTS: dict = {}


def _workload_surely_fits(inputs: HopperPlanInputs, num_heads: int, device) -> bool:
    """True when FlashInfer's _validate_fa_plan_workload cannot raise for these requests, so
    the ~70 us of Python it spends on every re-plan (lists of every request) can be skipped.
    Its checks (0.7.2) and why each passes here:
      * work items <= 16384: MLAPlan cuts each query tile's KV into chunks of at most
        kv_len_limit >= the average KV per cluster, so it makes at most (num_clusters + number
        of query tiles) work items; with the smallest tile (64 packed rows) the tiles number
        at most R + total_q * heads / 64;
      * its int32 range checks (the average KV per cluster, the rounded chunk limit, kv *
        cluster and kv + limit of each tile): every tile's KV is at most the longest request's,
        so the summed per-tile KV is at most max_kv * tiles, held below 2**30;
      * the causal tile bound: it returns at once when the query tile is a multiple of the
        head count, as here (and it is not needed for non-causal plans).
    Anything else (a causal plan whose tile is not a multiple of the heads, huge batches) goes
    to FlashInfer's own check."""
    arrays = inputs.arrays
    if arrays is None or device is None or getattr(device, "type", None) != "cuda":
        return False
    qo, _, kv = arrays
    num_requests = kv.shape[0]
    if num_requests == 0 or qo.shape[0] != num_requests + 1 or num_heads <= 0:
        return False
    total_q = int(qo[-1]) - int(qo[0])
    tile = 64 * (2 if total_q * num_heads // num_requests > 64 else 1)
    if inputs.causal and tile % num_heads:
        return False
    sm = _SM_COUNTS.get(device)
    if sm is None:
        sm = _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    tiles = plan_tile_bound(total_q, num_requests, num_heads)
    return sm + tiles <= _FA_MAX_WORK_ITEMS and int(kv.max()) * tiles < 2**30


def plan_tile_bound(total_q: int, num_requests: int, num_heads: int) -> int:
    """At least the query tiles of an MLA plan: ceil(q * heads / tile) <= q * heads / 64 + 1
    per request, tiles being 64 or 128 packed rows. MLAPlan makes at most num_clusters + this
    many work items (tests/v1/attention/test_flashinfer_mla_plan.py checks it against the
    planner model)."""
    return num_requests + -(-total_q * num_heads // 64)


OWN_PLAN_COPY_FLAG = "VLLM_MLA_NATIVE_PLAN_OWN_COPY"


def own_plan_copy_enabled() -> bool:
    """On by default since the thirteenth session (exact on the H200 on both paths, 0.23 ms
    less host time per native re-plan; see _plan_and_stage); 0 goes back to FlashInfer's own
    staging of the planner's workspace bytes through a new pinned buffer."""
    return switch_flag(OWN_PLAN_COPY_FLAG, True, "copy the native planner's workspace bytes "
                       "without a new pinned buffer", "FlashInfer's own staging")


# Per page-locked int workspace (by address): the event after the last copy out of it. The
# planner rewrites that workspace on the host, so it waits for the copy first (in steady
# decode the copy ran a step ago and the event has long completed).
_PINNED_COPY_EVENTS: dict[int, Any] = {}
_CHECKED_WORKSPACES: set = set()  # (pinned ptr, bytes, device ptr, bytes) found valid


def _wait_pinned_copy(pinned: torch.Tensor) -> None:
    event = _PINNED_COPY_EVENTS.get(pinned.data_ptr())
    if event is not None and not event.query():
        event.synchronize()


def _plan_and_stage(raw_plan, args: tuple) -> tuple[Any, int]:
    """FlashInfer's plan_with_staged_workspace_bytes without its per-call pinned buffer: the
    JIT planner writes the plan into the page-locked int workspace, whose used bytes are then
    copied to the device int workspace (non-blocking, as FlashInfer copies them). FlashInfer
    first copies them into a freshly allocated pinned buffer, so that its next plan may
    rewrite the workspace at once; that allocation made a native re-plan cost 2-3 ms of host
    time on the H200 (scripts/probe_replan.py, twelfth session; that the allocation is the
    cost is inferred from FlashInfer's code, not measured yet). Here the next plan waits for
    the copy instead (_wait_pinned_copy). On the H200 (thirteenth session, B=8 DSpark engine,
    scripts/probe_replan.py --own-copy both) a native re-plan took 0.38 ms this way against
    0.61 ms through FlashInfer's staging, the JIT planner itself 0.13 ms; both paths pass
    test_graph_wrapper_native_replans_with_the_packed_copy_match_torch_mla. The workspaces'
    checks run once per pair (is_pinned asks the CUDA driver)."""
    int_ws, pinned = args[1], args[2]
    key = (pinned.data_ptr(), pinned.nbytes, int_ws.data_ptr(), int_ws.nbytes)
    if key not in _CHECKED_WORKSPACES:
        if (pinned.device.type != "cpu" or not pinned.is_pinned() or not pinned.is_contiguous()
                or int_ws.device.type != "cuda" or not int_ws.is_contiguous()):
            raise ValueError("the MLA planner needs a pinned contiguous host int workspace and "
                             "a contiguous CUDA int workspace")
        _CHECKED_WORKSPACES.add(key)
    _wait_pinned_copy(pinned)
    plan_info, staged = raw_plan(*args)
    staged = int(staged)
    host, device = pinned.view(torch.uint8), int_ws.view(torch.uint8)
    if not 0 <= staged <= min(host.numel(), device.numel()):
        raise ValueError(f"the MLA planner returned staged_int_workspace_bytes={staged} for "
                         f"workspaces of {host.numel()} / {device.numel()} bytes")
    if staged:
        device[:staged].copy_(host[:staged], non_blocking=True)
        event = _PINNED_COPY_EVENTS.get(pinned.data_ptr())
        if event is None:
            event = _PINNED_COPY_EVENTS[pinned.data_ptr()] = torch.cuda.Event()
        record_event(event)
    return plan_info, staged


def _upload_csr(slot: _WrapperSlot, backend: Any, inputs: HopperPlanInputs, graph: bool) -> None:
    """Move a plan's CSR arrays to the buffers the kernels read (the fixed graph buffers)."""
    buffers = (backend._qo_indptr_buf, backend._kv_indptr_buf, backend._kv_indices_buf,
               backend._kv_len_arr_buf)
    if (graph and inputs.packed is not None and slot.packed_device is not None
            and inputs.packed_layout == slot.packed_layout
            and buffers[0].data_ptr() == slot.packed_device.data_ptr()):
        # The same layout on both sides: ONE copy instead of four (each launch costs the host
        # ~5 us); the kernels read the same four fixed buffers.
        slot.packed_device[: inputs.packed.shape[0]].copy_(inputs.packed, non_blocking=True)
    elif graph:  # the captured kernels read these fixed buffers
        buffers[0].copy_(inputs.qo_indptr, non_blocking=True)
        buffers[1].copy_(inputs.kv_indptr, non_blocking=True)
        buffers[2][: inputs.kv_indices.shape[0]].copy_(inputs.kv_indices, non_blocking=True)
        buffers[3].copy_(inputs.kv_len_arr, non_blocking=True)
    else:
        device = backend.device
        for name, source in (("_qo_indptr_buf", inputs.qo_indptr),
                             ("_kv_indptr_buf", inputs.kv_indptr),
                             ("_kv_indices_buf", inputs.kv_indices),
                             ("_kv_len_arr_buf", inputs.kv_len_arr)):
            moved = source.to(device, non_blocking=True)
            setattr(backend, name, moved)
            setattr(slot.wrapper, name, moved)


def _refresh(slot: _WrapperSlot, inputs: HopperPlanInputs, plan_args: dict) -> bool:
    """Steady decode on a graph wrapper: keep the held plan and rewrite only the work arrays
    that depend on the lengths (PlanSkeleton), when every request keeps its chunk count."""
    refresher = slot.refresher
    if refresher is None or slot.plan_args != plan_args:
        return False
    backend = getattr(slot.wrapper, "_planned_backend", None)
    # The held plan must be of the same causal flag (a wrapper serves one decode kind, so it
    # is; a causal plan has a skeleton only when every request is one query tile).
    held_causal = getattr(backend, "_causal", None)
    if backend is None or held_causal is None or bool(held_causal) != bool(inputs.causal):
        return False
    arrays = inputs.arrays or (inputs.qo_indptr.numpy(), inputs.kv_indptr.numpy(),
                               inputs.kv_len_arr.numpy())
    # Staged in this slot's ring: the work arrays share the set's buffer index and its event
    # (recorded by _plan after the copies), so the refresh records and queries none itself.
    staged_in = inputs.staged_in
    # (only while no later acquire moved the ring on: the consumed-mark guards the current set)
    ring_index = (staged_in[1] if staged_in is not None and staged_in[0] is slot.staging
                  and staged_in[1] == slot.staging.current_index else None)
    if not refresher.try_refresh(*arrays, ring_index=ring_index):
        return False
    _upload_csr(slot, backend, inputs, graph=True)
    return True


def _adopt_plan(slot: _WrapperSlot, inputs: HopperPlanInputs, plan_args: dict) -> None:
    """After a real plan on a graph wrapper: read its skeleton back for later refreshes."""
    backend = getattr(slot.wrapper, "_planned_backend", None)
    pinned = getattr(backend, "_pin_memory_int_workspace_buffer", None)
    device_ws = getattr(backend, "_int_workspace_buffer", None)
    plan_info = getattr(backend, "_plan_info", None)
    if pinned is None or device_ws is None or plan_info is None:
        if slot.refresher is not None:  # the held skeleton is of an older plan: drop it
            slot.refresher.adopt(None)
        return
    if slot.refresher is None or slot.refresher.device_ws.data_ptr() != device_ws.data_ptr():
        slot.refresher = PlanRefresher(device_ws,
                                       max_works=2 * inputs.num_requests + 1024,
                                       keep_plans=slot.keeps_plans)
    slot.refresher.adopt(PlanSkeleton.from_plan(
        plan_info, pinned, inputs.qo_indptr.numpy(), inputs.kv_len_arr.numpy(),
        plan_args["num_heads"], inputs.causal, draft=slot.draft))
    slot.refresher.keep(pinned)  # by its chunk structure, for later steps that reach it
    _plan_lone_request(slot, inputs, plan_args, backend)


def _plan_lone_request(slot: _WrapperSlot, inputs: HopperPlanInputs, plan_args: dict,
                       backend: Any) -> int:
    """The first real plan of a one-request layout on a graph wrapper: plan every chunk
    structure a lone request can reach up to slot.max_kv_len (single_request_lengths) and keep
    them (flashinfer_plan_cache.py says why). FlashInfer's JIT planner writes only the
    page-locked scratch (its Python layer copies that to the device; this does not), so the
    device workspace keeps the live plan; the scratch's last copy is waited for once, here.
    Returns the plans kept (0 where not applicable: more than one request, no cache, no JIT
    planner, a layout already done)."""
    refresher = slot.refresher
    held = refresher.skeleton
    cache = refresher.cache
    if (cache is None or held is None or held.num_real != 1 or slot.max_kv_len <= 0
            or held.qo_bytes in cache.warmed or inputs.arrays is None
            or capturing()):
        return 0
    cache.warmed.add(held.qo_bytes)
    module = getattr(backend, "_cached_module", None)
    raw_plan = getattr(getattr(module, "_module", None), "plan", None)
    if raw_plan is None:
        return 0
    pinned = backend._pin_memory_int_workspace_buffer
    _wait_pinned_copy(pinned)  # the live plan's copy out of the scratch has been made
    qo_np = inputs.arrays[0]
    qo = torch.from_numpy(qo_np.copy())
    kv_indptr = torch.zeros_like(qo)
    kv_len = torch.zeros(qo.shape[0] - 1, dtype=qo.dtype)
    heads, causal = plan_args["num_heads"], bool(inputs.causal)
    page = int(plan_args["page_size"])
    kept = 0
    for length in single_request_lengths(slot.max_kv_len, held.num_clusters):
        if len(cache) >= cache.capacity:
            break
        limit, counts = structure_of(np.array([length]), held.num_clusters)
        if cache.holds(held.qo_bytes, limit, counts):
            continue
        kv_len[0] = length
        kv_indptr[1:] = -(-length // page)
        plan_info, _ = raw_plan(backend._float_workspace_buffer, backend._int_workspace_buffer,
                                pinned, qo, kv_indptr, kv_len, heads,
                                plan_args["head_dim_ckv"], causal)
        skeleton = PlanSkeleton.from_plan(plan_info, pinned, qo_np, kv_len.numpy(), heads,
                                          causal, draft=slot.draft)
        if skeleton is None or skeleton.info != held.info:
            continue
        cache.store(skeleton, skeleton.info, pinned, refresher.device_ws.device)
        kept += 1
    return kept


def _put_back_kept(slot: _WrapperSlot, inputs: HopperPlanInputs, plan_args: dict) -> bool:
    """A graph wrapper whose held plan no longer fits the step's lengths: put back a plan kept
    for their chunk structure (flashinfer_plan_cache.py) and refresh it for them, in place of
    FlashInfer's planner; False, changing nothing, without one."""
    refresher = slot.refresher
    if refresher is None or refresher.cache is None or slot.plan_args != plan_args:
        return False
    backend = getattr(slot.wrapper, "_planned_backend", None)
    held_causal = getattr(backend, "_causal", None)
    if backend is None or held_causal is None or bool(held_causal) != bool(inputs.causal):
        return False
    arrays = inputs.arrays
    if arrays is None:
        return False
    qo, _, kv = arrays
    real = int(np.count_nonzero(qo[1:] != qo[:-1]))
    # the real requests first (plan_hopper_decode), padding requests empty
    if real == 0 or qo[real] != qo[-1] or kv[real:].any() or (kv[:real] <= 0).any():
        return False
    lengths = kv[:real]
    entry = refresher.find_kept(qo.tobytes(), lengths, lengths, slot.draft)
    if entry is None:
        return False
    refresher.put_back(entry)
    if not _refresh(slot, inputs, plan_args):  # cannot be: the kept plan is of this structure
        raise RuntimeError("a kept plan of the step's chunk structure refused its refresh")
    return True


def _plan(slot: _WrapperSlot, inputs: HopperPlanInputs, key: tuple, **plan_args) -> None:
    graph = slot.packed_device is not None
    # Graph wrappers in steady decode: refresh the held plan (flashinfer_plan_refresh.py);
    # otherwise re-plan natively, or make a full FlashInfer plan.
    if not (graph and (_refresh(slot, inputs, plan_args)
                       or _put_back_kept(slot, inputs, plan_args))):
        if not _native_replan(slot, inputs, plan_args):
            fi = _import_flashinfer()
            pinned = getattr(getattr(slot.wrapper, "_planned_backend", None),
                             "_pin_memory_int_workspace_buffer", None)
            if pinned is not None:
                _wait_pinned_copy(pinned)  # FlashInfer's plan may rewrite the same workspace
            slot.wrapper.plan(
                metadata=fi.mla.MLAPlanMetadata.csr(inputs.qo_indptr, inputs.kv_indptr,
                                                    inputs.kv_indices, inputs.kv_len_arr),
                causal=inputs.causal, **plan_args)
            slot.full_plans += 1
        else:
            slot.native_replans += 1
        if graph:
            _adopt_plan(slot, inputs, plan_args)
    if slot.staging is not None:
        slot.staging.mark_consumed_after_this_point()
    slot.plan_args = plan_args
    slot.planned_for = key


@dataclass
class BlackwellDecodeArgs:
    """Per-step trtllm call arguments that do not depend on the layer (built once per step)."""

    num_active: int                      # rows with queries (0: only padding rows)
    q_len: int                           # Q of the (first) active block
    query_layout: Literal["rows", "blocks", "varlen"] = "blocks"
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    bounds: torch.Tensor | None = None   # int32 global lengths (DCP only)
    extra: dict = field(default_factory=dict)


# Head tiles of FlashInfer's trtllm-gen MLA decode kernels on sm100.
TRTLLM_GEN_HEAD_TILES = (8, 16, 64)


def blackwell_decode_backend(num_heads: int, dcp_size: int) -> str:
    """The trtllm_batch_decode_with_kv_cache_mla backend for the runtime (gathered) head count.

    Under DCP the native DCP arguments need "cute-dsl". At DCP 1 "auto" (trtllm-gen) is used when
    it can tile the head count, i.e. h % min(h, tile) == 0 for every tile size; otherwise (e.g.
    24 or 96 heads) "cute-dsl", as upstream selects.
    """
    if dcp_size > 1:
        return "cute-dsl"
    if any(num_heads % min(num_heads, tile) for tile in TRTLLM_GEN_HEAD_TILES):
        return "cute-dsl"
    return "auto"


def plan_blackwell_decode(decode: MLACommonDecodeMetadata) -> BlackwellDecodeArgs:
    """Shape the decode rows for trtllm_batch_decode_with_kv_cache_mla, once per step."""
    qsl = decode.query_start_loc_cpu
    qlens = (qsl[1:] - qsl[:-1]).tolist()
    q_len, num_active, uniform = uniform_query_block(qlens)
    if num_active == 0:
        return BlackwellDecodeArgs(num_active=0, q_len=0)
    dcp = decode.dcp_world_size > 1
    seq_lens = decode.seq_lens[:num_active]
    bounds = decode.dcp_tot_seq_lens[:num_active] if dcp else None
    block_tables = decode.block_table[:num_active]
    extra: dict[str, Any] = {}
    if not decode.causal:
        # each block row becomes its own single-token request: table, local lengths
        # AND global bounds are all repeated per row
        layout = "rows"
        block_tables = block_tables.repeat_interleave(q_len, dim=0)
        seq_lens = seq_lens.repeat_interleave(q_len)
        bounds = bounds.repeat_interleave(q_len) if bounds is not None else None
    elif uniform:
        layout = "blocks"
    else:  # causal varlen: compact query described by cum_seq_lens_q
        layout = "varlen"
        extra = dict(cum_seq_lens_q=decode.query_start_loc.to(torch.int32),
                     max_q_len=max(qlens))
    return BlackwellDecodeArgs(
        num_active=num_active, q_len=q_len, query_layout=layout, block_tables=block_tables,
        seq_lens=seq_lens, bounds=bounds.to(torch.int32).contiguous() if dcp else None,
        extra=extra)


@dataclass
class FlashInferDecodeState:
    """Per-step backend state hung on MLACommonDecodeMetadata.backend_state."""

    kernel_family: KernelFamily
    natural_lse: bool = True
    hopper_inputs: HopperPlanInputs | None = None
    # row_seq_lens of a plan that has empty rows; `hopper_empty_rows` derives the mask from it
    # on demand (the forward pins those rows from row_seq_lens itself, so no per-step device op)
    empty_rows_source: torch.Tensor | None = None
    blackwell_args: BlackwellDecodeArgs | None = None
    wrapper_slot: _WrapperSlot | None = None
    workspace: torch.Tensor | None = None
    step_id: int = 0
    plan_calls: list = field(default_factory=list)  # keys planned this step (reuse check)
    planned_key: tuple | None = None  # set when the builder planned already (graph replay)

    @property
    def hopper_empty_rows(self) -> torch.Tensor | None:
        """[T] bool, rows seeing nothing (None when the plan has no empty row)."""
        source = self.empty_rows_source
        return None if source is None else source == 0


class FlashInferMLAMetadataBuilder(MLACommonMetadataBuilder):
    supports_non_causal_multi_token_decode = True
    supports_non_causal_multi_token_dcp = True
    supports_dcp_with_varlen = True
    prefill_backend = "flashinfer"  # ragged prefill (prefill.py), on CUDA devices

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                 device: torch.device | str, *, dcp_rank: int | None = None,
                 kernel_family: KernelFamily | None = None,
                 causal_mode: CausalPlanMode = "auto", natural_lse: bool = True,
                 workspace_bytes: int = DEFAULT_WORKSPACE_BYTES):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, dcp_rank=dcp_rank)
        self.kernel_family = kernel_family or detect_kernel_family(self.device)
        if self.kernel_family not in ("hopper", "blackwell"):
            raise ValueError(f"kernel_family={self.kernel_family!r}; use 'hopper' or 'blackwell'.")
        self.causal_mode = causal_mode
        self.natural_lse = natural_lse
        self.workspace_bytes = workspace_bytes
        self.page_size = int(kv_cache_spec.block_size)
        self.page_list_rebuild = page_list_rebuild_enabled()
        self.page_list_lookahead = page_list_lookahead_enabled()
        # the most requests a plan of this builder has in steady decode (graph sizes stop at
        # max_num_seqs): the page-list rebuild compiles one kernel variant for it
        self.max_plan_requests = int(getattr(vllm_config, "max_num_seqs", 0) or 64)
        if self.kernel_family == "blackwell":
            if self.dcp_world_size > 1 and self.dcp_interleave != 1:
                raise ValueError(
                    f"FLASHINFER_MLA on Blackwell supports DCP only with "
                    f"cp_kv_cache_interleave_size=1 (the kernel stores token t on rank "
                    f"t % N), got {self.dcp_interleave}; set cp_kv_cache_interleave_size=1 "
                    f"or use TORCH_MLA.")
            if self.page_size not in BLACKWELL_BLOCK_SIZES:
                raise ValueError(f"FLASHINFER_MLA on Blackwell needs block_size in "
                                 f"{BLACKWELL_BLOCK_SIZES}, got {self.page_size}.")
        self._workspace: torch.Tensor | None = None
        # Wrappers are keyed by the decode kind (Q=1 causal, causal multi-token, non-causal
        # block): a speculative engine whose policy switches between plain (Q=1) and verify
        # (Q=1+k) steps plans Q=1 with causal=False and verification with causal=True. A
        # wrapper shared by both would alternate its plan's causal flag, which FlashInfer's
        # native re-plan cannot follow: every switch was a full plan() (~1 ms of host time,
        # pinned allocations), twice per policy probe.
        self._slots: dict[MLADecodeKind, _WrapperSlot] = {}  # decode kind -> eager wrapper
        # (planned request count, decode kind) -> graph wrapper
        self._graph_slots: dict[tuple[int, MLADecodeKind], _WrapperSlot] = {}
        self._step = 0

    def _get_workspace(self) -> torch.Tensor:
        if self._workspace is None:
            # zero-initialised: the Blackwell kernels keep semaphores in it
            self._workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8,
                                          device=self.device)
        return self._workspace

    def _get_wrapper_slot(self, kind: MLADecodeKind = MLADecodeKind.CAUSAL_SINGLE
                          ) -> _WrapperSlot:
        # One wrapper per decode kind: a group built both causally (the target step, e.g. a
        # block drafter's group whose context KV the target step writes) and non-causally (the
        # draft step), or with Q=1 and Q=1+k rows, would otherwise alternate plans, and a plan
        # made for the other causal flag can never be re-planned natively.
        slot = self._slots.get(kind)
        if slot is None:
            fi = _import_flashinfer()
            # backend pinned: "auto" may wander to backends that reject sm90
            wrapper = fi.mla.BatchMLAPagedAttentionWrapper(self._get_workspace(), backend="fa3")
            # Eager steps: up to max_num_seqs blocks (larger plans, e.g. flattened causal rows,
            # fall back to fresh host tensors).
            max_seqs = int(getattr(self.vllm_config, "max_num_seqs", 0) or 64)
            slot = self._slots[kind] = _WrapperSlot(wrapper, staging=PlanStaging(
                max_seqs, max_seqs * self._max_pages_per_request()))
        return slot

    def _get_graph_wrapper_slot(self, num_requests: int,
                                kind: MLADecodeKind = MLADecodeKind.CAUSAL_SINGLE
                                ) -> _WrapperSlot:
        """A use_cuda_graph wrapper with fixed metadata buffers per planned request count and
        decode kind (each captured graph replays against its own wrapper; plan() refills the
        buffers in place). A plan of another kind's graph never touches this one's buffers."""
        slot = self._graph_slots.get((num_requests, kind))
        if slot is None:
            fi = _import_flashinfer()
            max_pages = num_requests * self._max_pages_per_request()
            # One device buffer, laid out like the staging sets: a native re-plan moves the
            # whole CSR in one copy.
            packed = torch.zeros(packed_csr_size(num_requests, max_pages), dtype=torch.int32,
                                 device=self.device)
            qo, kv_indptr, kv_len, kv_indices = packed_csr_views(packed, num_requests)
            buffers = dict(qo_indptr=qo, kv_indptr=kv_indptr, kv_indices=kv_indices,
                           kv_len_arr=kv_len)
            wrapper = fi.mla.BatchMLAPagedAttentionWrapper(
                self._get_workspace(), use_cuda_graph=True, backend="fa3", **buffers)
            # Depth 2: a graph wrapper is planned once per step. A set comes round again two
            # plans later, and its copy was enqueued before that older step's forward: a
            # synchronous step ends in the runner's synchronisation, and under async scheduling
            # the runner has waited for that step's inputs event (_retire_previous_step) before
            # this plan, so `acquire`'s event query finds it done and never blocks (the eager
            # wrapper keeps depth 8: EAGLE/MTP plan it k times within one step). The sets are
            # sized for full-length requests; a deeper ring would multiply that pinned memory.
            slot = self._graph_slots[(num_requests, kind)] = _WrapperSlot(
                wrapper, staging=PlanStaging(num_requests, max_pages, depth=2),
                packed_device=packed, packed_layout=(num_requests, max_pages),
                draft=kind == MLADecodeKind.NON_CAUSAL_BLOCK,
                max_kv_len=self._max_kv_len() if self.dcp_world_size == 1 else 0,
                keeps_plans=self.dcp_world_size == 1)
        return slot

    def _max_kv_len(self) -> int:
        model_config = getattr(self.vllm_config, "model_config", None)
        return int(getattr(model_config, "max_model_len", 0) or 0)

    def _max_pages_per_request(self) -> int:
        max_len = self._max_kv_len() + 64
        local = -(-max_len // self.dcp_world_size)
        return -(-local // self.page_size) + 1

    def build(self, common_prefix_len: int,
              common_attn_metadata: CommonAttentionMetadata) -> MLACommonMetadata:
        metadata = super().build(common_prefix_len, common_attn_metadata)
        decode = metadata.decode
        if decode is None:
            return metadata
        self._step += 1
        state = FlashInferDecodeState(kernel_family=self.kernel_family,
                                      natural_lse=self.natural_lse, step_id=self._step)
        if self.kernel_family == "hopper":
            if decode.cudagraph:
                num_requests = max_plan_requests(metadata.num_decodes, decode.max_query_len,
                                                 self.dcp_world_size)
                state.wrapper_slot = self._get_graph_wrapper_slot(num_requests, decode.kind)
                state.hopper_inputs = plan_hopper_decode(
                    decode, self.page_size, self.causal_mode, num_requests=num_requests,
                    staging=state.wrapper_slot.staging)
                # Fixed for the graph: padding tokens and empty rows are always pinned to 0/-inf.
                state.hopper_inputs.has_empty_rows = True
                slot = state.wrapper_slot
                if slot.plan_args is not None:  # replay: no layer runs, so plan here
                    key = ("graph", id(state), state.step_id)
                    _plan(slot, state.hopper_inputs, key, **slot.plan_args)
                    state.plan_calls.append(key)
                    state.planned_key = key
            else:
                state.wrapper_slot = self._get_wrapper_slot(decode.kind)
                state.hopper_inputs = plan_hopper_decode(decode, self.page_size, self.causal_mode,
                                                         staging=state.wrapper_slot.staging)
            if state.hopper_inputs is not None and state.hopper_inputs.has_empty_rows:
                state.empty_rows_source = decode.row_seq_lens
        else:
            state.workspace = self._get_workspace()
            state.blackwell_args = plan_blackwell_decode(decode)
        decode.backend_state = state
        return metadata

    def _held_graph_plan(self, metadata: MLACommonMetadata):
        """(decode, plan inputs, wrapper slot, refresher, skeleton, planned backend) of a
        decode-only Hopper CUDA-graph plan at DCP 1 that is still its slot's latest and has a
        refreshable skeleton (what lowering a plan's lengths in place needs), else None."""
        decode = metadata.decode
        if (decode is None or metadata.num_prefills or self.dcp_world_size != 1
                or self.kernel_family != "hopper" or not decode.cudagraph):
            return None
        state = decode.backend_state
        inputs = getattr(state, "hopper_inputs", None)
        slot = getattr(state, "wrapper_slot", None)
        if (inputs is None or slot is None or state.planned_key is None
                or inputs.request_rows is None or inputs.arrays is None
                or slot.planned_for != state.planned_key):
            return None  # not this slot's latest plan, or a layout this does not cover
        refresher = slot.refresher
        skeleton = None if refresher is None else refresher.skeleton
        backend = getattr(slot.wrapper, "_planned_backend", None)
        if skeleton is None or backend is None:
            return None
        return decode, inputs, slot, refresher, skeleton, backend

    def refresh_decode_seq_lens(self, metadata: MLACommonMetadata,
                                seq_lens_np: np.ndarray) -> bool:
        """Lower the lengths of a CUDA-graph decode plan built for upper-bound host lengths to
        the exact ones (`seq_lens_np`, one per decode request), in place of a new build. What
        it is for: the runner builds a block drafter's metadata while the verify step still
        runs, from the lengths all drafts accepted would give (the device buffers already hold
        the exact ones: the block input write computed them on the device), and calls this
        once the accepted counts reach the host.

        The CSR keeps the upper bound's pages (a request's pages past its length are never
        read: the kernels take a request's first page from kv_indptr and stop at kv_len); the
        new lengths go into kv_len_arr and, through the plan's skeleton, into the work items'
        kv_len / kv_end (flashinfer_plan_refresh.py). Only where that is the whole change:
        Hopper, DCP 1, decode rows only, one planned request per live block (every row then
        sees its request's length), lengths within the planned pages and every request keeping
        its chunk count. Anything else returns False and changes nothing (the caller builds
        again with the exact lengths)."""
        held = self._held_graph_plan(metadata)
        if held is None:
            return False
        decode, inputs, slot, refresher, skeleton, backend = held
        if (inputs.staged_in is None or inputs.staged_in[0] is not slot.staging
                or inputs.staged_in[1] != slot.staging.current_index
                or inputs.host_csr_stale):
            return False  # its staged set has moved on: the host refresh writes through it
        qo, kv_indptr, kv_len = inputs.arrays
        rows = inputs.request_rows
        n = rows.shape[0]
        new = np.asarray(seq_lens_np)[rows]
        if n == 0 or new.min() <= 0:
            return False
        page = self.page_size
        if ((new + (page - 1)) // page > kv_indptr[1:n + 1] - kv_indptr[:n]).any():
            return False  # more pages than the plan lists
        lengths = kv_len.copy()
        lengths[:n] = new
        if not skeleton.fits(qo, lengths):
            return False
        kv_len[:n] = new  # the staged set's pinned kv_len: what the device copy below reads
        if not refresher.try_refresh(qo, kv_indptr, kv_len, ring_index=inputs.staged_in[1]):
            raise RuntimeError("a plan skeleton that fits refused its refresh")  # cannot be
        backend._kv_len_arr_buf[:n].copy_(inputs.kv_len_arr[:n], non_blocking=True)
        # The set and its refresh buffer are read by copies enqueued now: guard them anew.
        slot.staging.mark_consumed_after_this_point()
        decode.row_seq_lens_cpu = None  # the upper bound's host rows are stale now
        return True

    def lower_decode_seq_lens_on_device(self, metadata: MLACommonMetadata,
                                        lower_seq_lens_np: np.ndarray) -> bool:
        """refresh_decode_seq_lens without the host lengths: the exact lengths are the
        metadata's device `seq_lens` (the block input write computed them on the device, in
        stream order), written into the plan's kv_len_arr and work arrays by device ops, so a
        caller can enqueue this BEFORE it waits for the step output that decides them. Valid
        when every length between `lower_seq_lens_np` (the host's lower bound, one per decode
        request: every draft rejected) and the planned upper bound keeps the plan's rows and
        chunk counts, which `fits` of the lower bound shows (the upper bound was planned).
        Same scope as refresh_decode_seq_lens, and only for plans whose requests are the first
        decode rows in order; anything else returns False and changes nothing."""
        held = self._held_graph_plan(metadata)
        if held is None:
            return False
        n = held[1].request_rows.shape[0]
        # the planned lengths are the upper bound; their pages were listed from this very
        # step's block table
        return self._lower_held_plan(held, lower_seq_lens_np, held[1].arrays[2][:n],
                                     same_step=True)

    def advance_decode_plan_on_device(self, metadata: MLACommonMetadata,
                                      bounds: tuple[np.ndarray, np.ndarray],
                                      fuse: FusedDraftLowering | None = None) -> bool:
        """lower_decode_seq_lens_on_device for a LATER step on a plan held from an earlier one,
        in place of a new build: `bounds` = (lower, upper), the host's bounds of this step's
        lengths (one per decode request; the device `seq_lens` hold the exact ones). What it is
        for: a block drafter's early draft step whose batch has the same rows as the previous
        step's; its requests grew, but while each still fits the pages the held plan lists and
        the skeleton's chunk counts for every length in [lower, upper], the only change a new
        build would make is the lengths, which this writes from the device (one launch), so
        the step skips the host build of its draft metadata. The CSR keeps the listed pages
        (the kernels stop at kv_len); the host's staged arrays keep the earlier lengths (they
        are read again only by a host refresh, which rewrites them first). Same scope as
        lower_decode_seq_lens_on_device; anything else returns False and changes nothing.
        `fuse` (a block drafter's early step, called BEFORE its input write): the device work
        that reads this step's lengths is handed to it (FusedDraftLowering) instead of being
        launched here: the lowering goes into the input write that computes the lengths, and
        a page-list rebuild runs after that write."""
        held = self._held_graph_plan(metadata)
        if held is None:
            return False
        return self._lower_held_plan(held, bounds[0], bounds[1], same_step=False, fuse=fuse)

    def _advance_plan(self, metadata: MLACommonMetadata, seq_lens_np: np.ndarray) -> bool:
        """advance_graph_step's plan part (a target step's graph plan, held from the step
        before): the exact host lengths bound the device ones from both sides, and the held
        plan must still list their pages and keep their chunk counts; then the lengths are
        written from the device in one launch (advance_decode_plan_on_device), in place of
        the host build and refresh. Hopper graph plans at DCP 1 only."""
        held = self._held_graph_plan(metadata)
        if held is None:
            return False
        n = held[1].request_rows.shape[0]
        exact = np.asarray(seq_lens_np)[:n]
        return self._lower_held_plan(held, exact, exact, same_step=False)

    def _page_lists_fit(self, decode: MLACommonDecodeMetadata, backend: Any,
                        need: np.ndarray) -> bool:
        """Whether `need` pages per request (the upper bound of each length) fit the device
        block table's width and the graph's page buffer: what a device rebuild of the page
        lists needs."""
        table = decode.block_table
        return not (table is None or table.dim() != 2 or table.stride(1) != 1
                    or int(need.max()) > table.shape[1]
                    or int(need.sum()) > backend._kv_indices_buf.shape[0])

    def _page_lookahead(self, decode: MLACommonDecodeMetadata, upper: np.ndarray,
                        n: int) -> int:
        """The tokens a device rebuild may list past every length of at most `upper`: the
        fewest any of the n rows holds in pages past its upper bound (its own pages, never a
        stale id past them). 0 without the pages held (no host count) or with the switch
        off."""
        held = decode.num_blocks_cpu
        if not self.page_list_lookahead or held is None or held.shape[0] < n:
            return 0
        return max(0, int((held[:n].astype(np.int64) * self.page_size - upper).min()))

    def _rebuild_page_lists(self, decode: MLACommonDecodeMetadata, inputs: HopperPlanInputs,
                            refresher: PlanRefresher, backend: Any, n: int,
                            fuse: FusedDraftLowering | None = None,
                            lookahead: int = 0) -> None:
        """A held plan whose requests grew into pages it does not list (or whose rows hold
        other pages now, or a plan just put back from the plan cache, whose works' first
        pages are another step's) keeps its chunks: write its page lists from the device
        block table and the device lengths (plan_lowering.py, one launch on CUDA) into the
        buffers the kernels read, as a host plan would list them. The caller has checked
        _page_lists_fit. With `fuse` the launch waits for the lengths' write (fuse.after).
        `lookahead`: each request also lists the pages of that many tokens past its length
        (_page_lookahead bounds it by the pages its row holds)."""
        launch = functools.partial(
            refresher.rebuild_page_lists_on_device, decode.block_table, decode.seq_lens, n,
            inputs.num_requests, backend._kv_indptr_buf, backend._kv_indices_buf,
            self.page_size, max_requests=max(self.max_plan_requests, inputs.num_requests),
            lookahead=lookahead)
        if fuse is None:
            launch()
        else:
            fuse.after.append(launch)
        inputs.host_csr_stale = True
        inputs.rebuilt_lists = None

    @staticmethod
    def _rebuilt_lists_hold(inputs: HopperPlanInputs, table: np.ndarray, need: np.ndarray,
                            n: int) -> bool:
        """Whether the page lists the last device rebuild wrote (`rebuilt_lists`) serve
        lengths of up to `need` pages per request: every request lists at least that many
        and its row of the block table still holds them."""
        lists = inputs.rebuilt_lists
        if lists is None:
            return False
        listed, rows = lists
        if listed.shape[0] != n or (need > listed).any():
            return False
        width = int(need.max())
        read = _arange(width) < need[:, None]  # the pages the kernels may read
        return np.array_equal(table[:n, :width][read], rows[:, :width][read])

    def _lower_held_plan(self, held: tuple, lower_np, upper_np, same_step: bool,
                         fuse: FusedDraftLowering | None = None) -> bool:
        """Write the device lengths into the held plan (`_held_graph_plan`) where every length
        in [lower, upper] (host bounds, one per decode request) keeps its rows, listed pages and
        chunk counts; False, changing nothing, otherwise. `same_step`: the plan was built for
        this step (upper = its planned lengths), so its pages are this step's rows' own.
        Lengths of another chunk structure take a plan kept for that structure
        (flashinfer_plan_cache.py), put back on the device with its page lists rebuilt there;
        without one (or without the page-list rebuild) they are refused. `fuse`: the lengths
        are not on the device yet (advance_decode_plan_on_device says what happens instead)."""
        decode, inputs, slot, refresher, skeleton, backend = held
        rows = inputs.request_rows
        n = rows.shape[0]
        if inputs.rows_first is None:
            inputs.rows_first = bool(n > 0 and np.array_equal(rows, _arange(n)))
        if not inputs.rows_first:
            return False  # the device lengths are read as the first n rows
        lower, upper = np.asarray(lower_np)[:n], np.asarray(upper_np)[:n]
        if (lower.shape[0] != n or upper.shape[0] != n or lower.min() <= 0
                or (lower > upper).any() or n != skeleton.num_real):
            return False
        # The skeleton's fit (PlanSkeleton.fits) of every length in [lower, upper]: the rows
        # are the held plan's own and the padding requests stay empty, so only the chunk
        # bounds of the real requests are left to check (first: the cheapest refusal).
        kept = None
        if not ((lower > skeleton.lo).all() and (upper <= skeleton.hi).all()):
            kept = refresher.find_kept(skeleton.qo_bytes, lower, upper, slot.draft)
            if kept is None or not self.page_list_rebuild:
                return False
        rebuild = kept is not None  # a kept plan's works list another step's first pages
        if same_step and not rebuild:  # this step's own pages, listed by its own build
            need = table = None
        else:
            page = self.page_size
            need = (upper + (page - 1)) // page  # pages of the longest lengths possible
            table = decode.block_table_cpu
            if table is not None:
                table = np.ascontiguousarray(table.numpy())
        if not (same_step or rebuild):
            if table is None:
                rebuild = True
            elif inputs.host_csr_stale:  # the device lists are the last rebuild's
                rebuild = not self._rebuilt_lists_hold(inputs, table, need, n)
            else:
                where, listed, counts = _page_check(inputs, n, table.shape[1])
                # a length past the pages the plan lists, or listed pages that are not
                # the rows' pages any more (the batch's rows may hold other requests now:
                # same count, other requests), whose ids the kernels read
                rebuild = bool((need > counts).any()) or not np.array_equal(
                    table.reshape(-1).take(where), listed)
        if rebuild:
            if not self.page_list_rebuild:
                return False
            ahead = self._page_lookahead(decode, upper, n) if table is not None else 0
            listed_need = need
            if ahead:
                listed_need = (upper + (ahead + page - 1)) // page
                if not self._page_lists_fit(decode, backend, listed_need):
                    ahead, listed_need = 0, need
            # (lists that fit with the lookahead fit without it: checked once either way)
            if not ahead and not self._page_lists_fit(decode, backend, need):
                return False
            if kept is not None:
                refresher.put_back(kept)  # stream-ordered before the lengths' write either way
            self._rebuild_page_lists(decode, inputs, refresher, backend, n, fuse, ahead)
            # What the device lists now, for the next advance: the device lengths lie in
            # [lower, upper], so every request lists at least the pages of its lower bound
            # plus the lookahead, cut from these rows (the host twin the device table copies;
            # without a twin the next advance rebuilds again).
            inputs.rebuilt_lists = None if table is None else (
                (lower + (ahead + page - 1)) // page, table[:n, :int(listed_need.max())].copy())
        # the work arrays and the wrapper's kv_len_arr, in one launch on CUDA (or in the
        # launch that writes the lengths: fuse)
        if fuse is not None and fuse.takes(decode.seq_lens, n):
            fuse.lowerings.append(refresher.lowering(n, backend._kv_len_arr_buf))
        elif fuse is not None:
            fuse.after.append(functools.partial(refresher.lower_on_device, decode.seq_lens, n,
                                                backend._kv_len_arr_buf))
        else:
            refresher.lower_on_device(decode.seq_lens, n, backend._kv_len_arr_buf)
        decode.row_seq_lens_cpu = None  # the planned host rows are stale now
        return True


class FlashInferMLAImpl(MLACommonImpl):

    def __init__(self, num_heads: int, scale: float, kv_lora_rank: int = 512,
                 qk_rope_head_dim: int = 64, qk_nope_head_dim: int = 128, **kwargs: Any):
        super().__init__(num_heads, scale, kv_lora_rank, qk_rope_head_dim)
        self.qk_nope_head_dim = qk_nope_head_dim

    def forward_decode(self, q: torch.Tensor, kv_cache: torch.Tensor,
                       decode_meta: MLACommonDecodeMetadata
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_decode_inputs(q, kv_cache, decode_meta)
        state = decode_meta.backend_state
        if not isinstance(state, FlashInferDecodeState):
            raise ValueError(
                "FLASHINFER_MLA impl got decode metadata that FlashInferMLAMetadataBuilder did not "
                "build (the layer's KV cache group uses another backend); the runner binds one "
                "backend per group: builder and layers must agree.")
        if q.dtype not in _FA3_DTYPES or kv_cache.dtype != q.dtype:
            raise ValueError(
                f"FLASHINFER_MLA kernels need bf16/fp16 q and cache of one dtype (got q {q.dtype}, "
                f"cache {kv_cache.dtype}); run with dtype=bfloat16 or attention_backend=TORCH_MLA.")
        if state.kernel_family == "hopper":
            return self._forward_hopper(q, kv_cache, decode_meta, state)
        return self._forward_blackwell(q, kv_cache, decode_meta, state)

    # ----------------------------------------------------------------- Hopper
    def _forward_hopper(self, q, kv_cache, decode_meta, state: FlashInferDecodeState):
        inputs = state.hopper_inputs
        if inputs is None:  # only zero-length padding rows
            return (q.new_zeros(q.shape[0], q.shape[1], self.kv_lora_rank),
                    torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device))
        slot = state.wrapper_slot
        key = state.planned_key or (id(state), state.step_id, q.shape[1], q.dtype,
                                    kv_cache.dtype, self.scale, kv_cache.shape[1])
        if slot.planned_for != key:
            _plan(slot, inputs, key, num_heads=q.shape[1], head_dim_ckv=self.kv_lora_rank,
                  head_dim_kpe=self.qk_rope_head_dim, page_size=kv_cache.shape[1],
                  sm_scale=self.scale, q_data_type=q.dtype, kv_data_type=kv_cache.dtype,
                  lse_mode="basee" if state.natural_lse else "base2")
            state.plan_calls.append(key)
        out, lse = slot.wrapper.run(query=q, kv_cache=kv_cache, return_lse=True,
                                    return_lse_base_on_e=state.natural_lse)
        if not state.natural_lse:
            lse = lse * LN2  # base 2 -> natural log, once, at the backend boundary
        if inputs.has_empty_rows:
            # Pin the contract (O=0, LSE=-inf) for rows this rank holds nothing of (and for
            # CUDA-graph padding tokens), whatever the kernel leaves there, so the DCP merge
            # ignores them. Computed here from the persistent row_seq_lens, so a graph replay
            # reads the current step's values.
            empty = decode_meta.row_seq_lens[: q.shape[0]] == 0
            out = out.masked_fill(empty[:, None, None], 0.0)
            lse = lse.masked_fill(empty[:, None], float("-inf"))
        return out, lse

    # -------------------------------------------------------------- Blackwell
    def _forward_blackwell(self, q, kv_cache, decode_meta: MLACommonDecodeMetadata,
                           state: FlashInferDecodeState):
        fi = _import_flashinfer()
        num_tokens, num_heads, width = q.shape
        args = state.blackwell_args
        if args.num_active == 0:
            return (q.new_zeros(num_tokens, num_heads, self.kv_lora_rank),
                    torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32,
                               device=q.device))
        dcp = decode_meta.dcp_world_size > 1
        if args.query_layout == "rows":
            query = q.view(args.num_active * args.q_len, 1, num_heads, width)
        elif args.query_layout == "blocks":
            query = q.view(args.num_active, args.q_len, num_heads, width)
        else:
            query = q
        out, lse = fi.decode.trtllm_batch_decode_with_kv_cache_mla(
            query=query, kv_cache=kv_cache.unsqueeze(1), workspace_buffer=state.workspace,
            qk_nope_head_dim=self.qk_nope_head_dim, kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim, block_tables=args.block_tables,
            seq_lens=args.seq_lens, max_seq_len=decode_meta.max_seq_len,
            bmm1_scale=self.scale, bmm2_scale=1.0,
            backend=blackwell_decode_backend(num_heads, decode_meta.dcp_world_size),
            return_lse=True,
            return_lse_base="basee" if state.natural_lse else "base2",
            enable_dcp=dcp, cp_world=decode_meta.dcp_world_size if dcp else 1,
            cp_rank=decode_meta.dcp_rank if dcp else 0,
            causal_seqlens_kv_global=args.bounds, **args.extra)
        out = out.reshape(num_tokens, num_heads, self.kv_lora_rank)
        lse = lse.reshape(num_tokens, num_heads).float()
        if not state.natural_lse:
            lse = lse * LN2
        return out, lse


class FlashInferMLABackend(AttentionBackend):
    lse_base_on_e = True  # converted at the impl boundary

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER_MLA"

    @staticmethod
    def get_builder_cls() -> type:
        return FlashInferMLAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type:
        return FlashInferMLAImpl
