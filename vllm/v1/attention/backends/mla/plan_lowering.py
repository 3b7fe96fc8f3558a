"""Lower a held FlashInfer MLA plan to lengths only the device knows yet, in one launch.

What it writes (PlanRefresher.lower_on_device; flashinfer_plan_refresh.py says what a plan's
work arrays are): for a plan made from host upper bounds, with the exact lengths `lens[r]` of
its requests on the device,
  ws[len_pos[i]] = lens[len_req[i]]   every real work's kv_len,
  ws[end_pos[j]] = lens[end_req[j]]   every request-ending work's kv_end,
  kv_len_arr[r]  = lens[r]            the wrapper's per-request lengths (r < num_reqs),
where `index` is the flat int64 [len_pos, len_req, end_pos, end_req] of the held skeleton.

With the page lists too (`rebuild_csr_*`, a second launch): when a request's length crossed
into a page the held plan does not list, or a row holds other pages now, the CSR is written
from the device block table and lengths, as a host plan would list it:
  kv_indptr[i + 1] = sum of pages[<= i]   pages[r] = ceil((lens[r] + lookahead) / page_size),
                                          padding requests 0,
  kv_indices[kv_indptr[r] + p] = table[r, p]   for p < pages[r],
  ws[indptr_pos + w] = kv_indptr[work_req[w]]  every work's first page (padding works: the
                                              padding request's, i.e. the total),
so the plan's chunks (token ranges) carry over unchanged and only where they read changes.
`lookahead` (tokens, default 0: what a host plan lists) lists pages past each length too,
pages the rows already hold (the caller bounds it by them): the kernels read a request's pages
only up to its kv_len, so extra trailing pages change no output, and the next advances whose
lengths grew into them find them listed and need no rebuild (flashinfer_mla's
PAGE_LIST_LOOKAHEAD_FLAG says what that saves).

Why one kernel: the torch form is five launches (two index_select, two index_copy_, a copy),
each ~10-15 us of host time on the H100 node. Measured there (twenty-third session, runs on
one H100, `probe_spec_step.py` with the early draft launch on and off in one host): the launch
before the wait took ~0.16 ms of host work out of a B=1 DSpark step's proposal, and the device
lowering's launches put about as much back, so the step did not get shorter. The torch form
stays as the reference and the CPU path.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from vllm.triton_utils import HAS_TRITON, tl, triton
from vllm.utils.triton_launch import LeanLaunch, base_and_offset

_BLOCK = 128

if HAS_TRITON:

    @triton.jit(do_not_specialize=["num_len", "num_end", "num_reqs"])
    def _lower_plan_kernel(ws_ptr, index_ptr, lens_ptr, kv_len_arr_ptr, num_len, num_end,
                           num_reqs, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        # every real work's kv_len (the first 2 * num_len entries of the index)
        on = i < num_len
        pos = tl.load(index_ptr + i, mask=on, other=0)
        req = tl.load(index_ptr + num_len + i, mask=on, other=0)
        tl.store(ws_ptr + pos, tl.load(lens_ptr + req, mask=on, other=0).to(tl.int32), mask=on)
        # the kv_end of every work that ends its request's KV (the next 2 * num_end)
        on = i < num_end
        base = 2 * num_len
        pos = tl.load(index_ptr + base + i, mask=on, other=0)
        req = tl.load(index_ptr + base + num_end + i, mask=on, other=0)
        tl.store(ws_ptr + pos, tl.load(lens_ptr + req, mask=on, other=0).to(tl.int32), mask=on)
        # the wrapper's kv_len_arr of the requests
        on = i < num_reqs
        lens = tl.load(lens_ptr + i, mask=on, other=0)
        tl.store(kv_len_arr_ptr + i, lens.to(kv_len_arr_ptr.dtype.element_ty), mask=on)


    # One compiled variant per block table / lengths dtype: the CSR arrays come as their base
    # buffer plus element offsets and BLOCK_R is the builder's bound, not the plan's size.
    @triton.jit(do_not_specialize=["table_stride", "num_reqs", "num_planned", "indptr_off",
                                   "indices_off", "indptr_pos", "num_works", "page_size",
                                   "lookahead"])
    def _rebuild_csr_kernel(table_ptr, table_stride, lens_ptr, num_reqs, num_planned,
                            indptr_base_ptr, indptr_off, indices_base_ptr, indices_off, ws_ptr,
                            indptr_pos, work_req_ptr, num_works, page_size, lookahead,
                            BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_W: tl.constexpr):
        kv_indptr_ptr = indptr_base_ptr + indptr_off
        kv_indices_ptr = indices_base_ptr + indices_off
        pid = tl.program_id(0)
        r = tl.arange(0, BLOCK_R)
        real = r < num_reqs
        lens = tl.load(lens_ptr + r, mask=real, other=0).to(tl.int32)
        pages = tl.where(real, (lens + lookahead + page_size - 1) // page_size, 0)
        if pid < num_reqs:  # one program per request: its page ids
            start = tl.sum(tl.where(r < pid, pages, 0), axis=0)
            count = tl.sum(tl.where(r == pid, pages, 0), axis=0)
            row = table_ptr + pid.to(tl.int64) * table_stride
            for p0 in range(0, count, BLOCK_P):
                p = p0 + tl.arange(0, BLOCK_P)
                on = p < count
                tl.store(kv_indices_ptr + start + p, tl.load(row + p, mask=on, other=0), mask=on)
        else:  # the last program: the request offsets and every work's first page
            ends = tl.cumsum(pages, axis=0)
            tl.store(kv_indptr_ptr + 1 + r, ends, mask=r < num_planned)
            tl.store(kv_indptr_ptr + r, tl.zeros_like(ends), mask=r == 0)
            for w0 in range(0, num_works, BLOCK_W):
                w = w0 + tl.arange(0, BLOCK_W)
                on = w < num_works
                req = tl.load(work_req_ptr + w, mask=on, other=0).to(tl.int32)
                first = tl.sum(tl.where(r[None, :] < req[:, None], pages[None, :], 0), axis=1)
                tl.store(ws_ptr + indptr_pos + w, first, mask=on)


# Through LeanLaunch (vllm/utils/triton_launch.py; off unless VLLM_LEAN_TRITON_LAUNCH=1).
_LOWER_PLAN_LAUNCH = LeanLaunch(_lower_plan_kernel) if HAS_TRITON else None
_REBUILD_CSR_LAUNCH = LeanLaunch(_rebuild_csr_kernel) if HAS_TRITON else None
_BLOCK_P, _BLOCK_W = 64, 32


def csr_block(max_requests: int) -> int:
    """The rebuild's BLOCK_R for plans of up to `max_requests` requests (a builder's bound)."""
    return triton.next_power_of_2(max(int(max_requests), 16)) if HAS_TRITON else 0


def rebuild_csr_triton(table: torch.Tensor, lens: torch.Tensor, num_reqs: int,
                       num_planned: int, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                       ws: torch.Tensor, indptr_pos: int, work_req: torch.Tensor,
                       page_size: int, max_requests: int | None = None,
                       lookahead: int = 0) -> None:
    """The page lists of the module docstring in one launch: `table` [>= num_reqs, W] int32
    (row r = request r), `lens` the requests' lengths (first num_reqs), `kv_indptr`
    [num_planned + 1] and `kv_indices` int32, `ws` the int32 workspace whose work kv_indptr
    starts at element `indptr_pos`, `work_req` [W] int64 each work's request (padding works:
    num_reqs). All on one CUDA device (or CPU under TRITON_INTERPRET=1). `max_requests`
    (default num_planned): the most requests any plan of the caller has, which sets the
    compiled variant (csr_block)."""
    if not HAS_TRITON:
        raise RuntimeError("rebuild_csr_triton needs Triton; use rebuild_csr_torch")
    if table.stride(1) != 1:
        raise ValueError("rebuild_csr_triton reads the block table's rows contiguously")
    block_r = csr_block(num_planned if max_requests is None else max_requests)
    if num_planned > block_r:
        raise ValueError(f"{num_planned} planned requests exceed max_requests={max_requests}")
    indptr_base, indptr_off = base_and_offset(kv_indptr)
    indices_base, indices_off = base_and_offset(kv_indices)
    _REBUILD_CSR_LAUNCH((num_reqs + 1,), table, table.stride(0), lens, num_reqs, num_planned,
                        indptr_base, indptr_off, indices_base, indices_off, ws, indptr_pos,
                        work_req, work_req.shape[0], page_size, int(lookahead), BLOCK_R=block_r,
                        BLOCK_P=_BLOCK_P, BLOCK_W=_BLOCK_W)


def rebuild_csr_torch(table: torch.Tensor, lens: torch.Tensor, num_reqs: int,
                      num_planned: int, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                      ws: torch.Tensor, indptr_pos: int, work_req: torch.Tensor,
                      page_size: int, max_requests: int | None = None,
                      lookahead: int = 0) -> None:
    """The same writes with torch ops (the reference, and the path off CUDA: its boolean
    selection reads the page counts on the host)."""
    pages = (lens[:num_reqs].to(torch.int64) + (int(lookahead) + page_size - 1)) // page_size
    indptr = torch.zeros(num_planned + 1, dtype=torch.int64, device=lens.device)
    indptr[1:num_reqs + 1] = torch.cumsum(pages, 0)
    indptr[num_reqs + 1:] = indptr[num_reqs]
    kv_indptr[:num_planned + 1].copy_(indptr)
    cols = torch.arange(table.shape[1], device=table.device)
    ids = table[:num_reqs][cols[None, :] < pages[:, None]]
    kv_indices[:ids.shape[0]].copy_(ids)
    ws[indptr_pos:indptr_pos + work_req.shape[0]].copy_(indptr[work_req])


def lower_plan_triton(ws: torch.Tensor, index: torch.Tensor, lens: torch.Tensor,
                      kv_len_arr: torch.Tensor, num_len: int, num_end: int,
                      num_reqs: int) -> None:
    """The module's writes in one launch (ws int32, index int64 flat, lens / kv_len_arr any
    integer dtype, all on one CUDA device, or CPU under TRITON_INTERPRET=1)."""
    if not HAS_TRITON:
        raise RuntimeError("lower_plan_triton needs Triton; use lower_plan_torch")
    rows = max(num_len, num_end, num_reqs)
    if rows <= 0:
        return
    _LOWER_PLAN_LAUNCH((triton.cdiv(rows, _BLOCK),), ws, index, lens, kv_len_arr, num_len,
                       num_end, num_reqs, BLOCK=_BLOCK)


def warm_plan_lowering(device: torch.device) -> None:
    """Compile the lowering kernel's variants at start-up (next to the graph captures) instead
    of in the first step that lowers a plan (Triton, about a second). Triton specialises a
    pointer on its 16-byte alignment: the graph wrappers' kv_len_arr sits 2 * (R + 1) int32
    into their packed CSR buffer (flashinfer_mla.packed_csr_views), aligned for odd R only,
    so both alignments are compiled; the workspace, the index and the int32 lengths are
    aligned. Scratch tensors only: nothing a step reads is written."""
    if HAS_TRITON and torch.device(device).type == "cuda":
        _warm_launches(device)


def warm_page_list_rebuild(device: torch.device, max_requests: int) -> None:
    """Compile the page-list rebuild's one variant for plans of up to `max_requests` requests
    (csr_block) at start-up, on scratch tensors laid out as a graph wrapper's (int32 block
    table and lengths, the CSR arrays as views into one packed int32 buffer, the int32
    workspace, an int64 work map)."""
    if HAS_TRITON and torch.device(device).type == "cuda":
        _warm_rebuild_launch(device, max_requests)


def _warm_rebuild_launch(device, max_requests: int) -> None:
    flat = torch.zeros(64, dtype=torch.int32, device=device)
    rebuild_csr_triton(torch.zeros(2, 4, dtype=torch.int32, device=device),
                       torch.ones(1, dtype=torch.int32, device=device), 1, 2, flat[3:6],
                       flat[9:], torch.zeros(8, dtype=torch.int32, device=device), 0,
                       torch.zeros(1, dtype=torch.int64, device=device), 16,
                       max_requests=max_requests)


def _warm_launches(device) -> None:
    """warm_plan_lowering's launches (any device: the tests record them on the CPU)."""
    ws = torch.zeros(64, dtype=torch.int32, device=device)
    index = torch.zeros(4, dtype=torch.int64, device=device)
    lens = torch.ones(2, dtype=torch.int32, device=device)
    arr = torch.zeros(8, dtype=torch.int32, device=device)
    for offset in (0, 1):
        lower_plan_triton(ws, index, lens, arr[offset:offset + 2], 1, 1, 1)


@dataclass
class PlanLowering:
    """A held plan's lowering (the writes of lower_plan_*) handed to the launch that writes the
    lengths themselves, instead of a launch of its own: a block drafter's input write computes
    each row's draft seq_len and can store it into the plan's work arrays in the same program
    (block_inputs.py). Why: the early draft step's plan advance was one more Triton launch a
    step, on the host, for a speculative engine only (twenty-eighth session). `lens` of the
    module's writes are the lengths that launch writes, rows in order (the plan's requests are
    its first `num_reqs` rows)."""

    ws: torch.Tensor          # the plan's int32 workspace
    index: torch.Tensor       # [2 * num_len + 2 * num_end] int64 (lower_plan_triton's)
    num_len: int
    num_end: int
    # the wrapper's kv_len_arr (its first num_reqs get the lengths); None: not written (only
    # a launch of its own, `launch`, takes None; the block input write needs one)
    kv_len_arr: torch.Tensor | None
    num_reqs: int

    def apply_torch(self, lens: torch.Tensor) -> None:
        """The same writes with torch ops from `lens` (the CPU path, and the reference)."""
        lower_plan_torch(self.ws, self.index, lens, self.kv_len_arr, self.num_len,
                         self.num_end, self.num_reqs)

    def launch(self, lens: torch.Tensor) -> None:
        """The writes as a launch of their own (PlanRefresher.lower_on_device's), from `lens`:
        on CUDA one Triton launch, else torch ops."""
        arr = self.kv_len_arr
        if self.ws.is_cuda and HAS_TRITON and (arr is None or arr.is_cuda):
            # (without kv_len_arr the kernel's third write is off: 0 rows, any pointer)
            lower_plan_triton(self.ws, self.index, lens, self.ws if arr is None else arr,
                              self.num_len, self.num_end, 0 if arr is None else self.num_reqs)
        else:
            self.apply_torch(lens)


@dataclass
class FusedDraftLowering:
    """What a block drafter's early draft step collects from its groups' plan advances, asked
    BEFORE its input write (BlockSpeculator.prepare_early): at most one lowering that the write
    performs (a plan whose lengths are the write's own rows: `takes`), and device work to
    enqueue right after the write (page-list rebuilds, any other group's lowering), all of
    which read the lengths the write stores. Host checks, put-backs of kept plans and host
    bookkeeping happen at the advance itself, in stream order before the write."""

    seq_lens: torch.Tensor   # the write's seq_lens buffer (rows in order)
    num_reqs: int            # the write's real rows
    lowerings: list[PlanLowering] = field(default_factory=list)
    after: list[Callable[[], None]] = field(default_factory=list)

    def takes(self, lens: torch.Tensor, num_reqs: int) -> bool:
        """Whether a plan reading `lens` (its first num_reqs) can be lowered by the write:
        the same rows of the same buffer, and no other plan lowered by it yet."""
        return (not self.lowerings and num_reqs == self.num_reqs
                and lens.dtype == self.seq_lens.dtype and lens.device == self.seq_lens.device
                and lens.data_ptr() == self.seq_lens.data_ptr())

    def lowering(self) -> PlanLowering | None:
        return self.lowerings[0] if self.lowerings else None

    def finish(self, written: bool) -> None:
        """Enqueue the work that follows the write, in the order it was asked for; first, when
        the write did not perform the lowering (`written` False: the caller passed none, e.g.
        because a later group refused), that lowering as a launch of its own."""
        if not written:
            for lowering in self.lowerings:
                lowering.launch(self.seq_lens)
        self.lowerings.clear()
        for launch in self.after:
            launch()
        self.after.clear()


def lower_plan_torch(ws: torch.Tensor, index: torch.Tensor, lens: torch.Tensor,
                     kv_len_arr: torch.Tensor | None, num_len: int, num_end: int,
                     num_reqs: int) -> None:
    """The same writes with torch ops (the reference, and the path off CUDA)."""
    n, m = num_len, num_end
    values = lens[:num_reqs].to(torch.int32)
    ws.index_copy_(0, index[:n], values.index_select(0, index[n:2 * n]))
    ws.index_copy_(0, index[2 * n:2 * n + m],
                   values.index_select(0, index[2 * n + m:2 * n + 2 * m]))
    if kv_len_arr is not None:
        kv_len_arr[:num_reqs].copy_(lens[:num_reqs])
