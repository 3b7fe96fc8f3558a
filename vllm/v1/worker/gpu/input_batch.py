"""The step's inputs: persistent buffers (`InputBuffers`) and the one owner of a step (`InputBatch`).

`InputBatchBuilder.build` is called once per step by the runner. The host lays out the batch
(decode rows first, then prefills) from what it knows exactly (num_computed, the scheduled counts)
and fills pinned host twins; one non-blocking copy moves the small per-row arrays to the device,
where input_ids, positions, seq_lens, rank-local lengths, slot mappings and logits indices are
computed from the slot-indexed request state (no token ids from the host on the decode path, no
host sync). Planners (FlashInfer plan, the MLA builder) read only the host twins.

Every buffer is allocated once at its maximum size and only written in place: CUDA graphs capture
their addresses, and attention metadata hands out views of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from operator import is_not

import numpy as np
import torch

from vllm.v1.worker.gpu.buffer_utils import CpuGpuBuffer
from vllm.v1.worker.gpu.cp_utils import (HAS_TRITON, get_dcp_local_seq_lens,
                                         prepare_dcp_local_seq_lens)

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _prepare_inputs_kernel(
        input_ids_ptr, positions_ptr, seq_lens_ptr, logits_idx_ptr,
        qsl_ptr, idx_ptr, is_prefill_ptr, prefill_ids_ptr, cu_logits_ptr,
        num_computed_ptr, last_sampled_ptr, drafts_ptr, drafts_stride, num_draft_cols,
        num_reqs, num_rows, num_tokens_padded, max_rows,
        BLOCK: tl.constexpr,
    ):
        """One program per batch row (+ one for the padding tail): positions, input ids (anchor
        and drafts gathered from the slot-indexed state, or staged prefill ids), seq_len and the
        row's logits indices. Rows in [num_reqs, num_rows) are zero-length padding."""
        row = tl.program_id(0)
        if row < num_rows:
            start = tl.load(qsl_ptr + row).to(tl.int64)
            end = tl.load(qsl_ptr + row + 1).to(tl.int64)
            slot = tl.load(idx_ptr + row).to(tl.int64)
            computed = tl.load(num_computed_ptr + row).to(tl.int64)  # row-indexed (staged)
            prefill = tl.load(is_prefill_ptr + row).to(tl.int1)
            anchor = tl.load(last_sampled_ptr + slot)
            seq_len = tl.where(row < num_reqs, computed + end - start, 0)
            tl.store(seq_lens_ptr + row, seq_len.to(seq_lens_ptr.dtype.element_ty))
            for first in range(start, end, BLOCK):
                offs = first + tl.arange(0, BLOCK)
                live = offs < end
                j = offs - start
                tl.store(positions_ptr + offs, computed + j, mask=live)
                # Drafts only for decode rows, inside the [slots, k] buffer (a prefill row's
                # offsets run far past k: never read the draft buffer for them).
                col = tl.minimum(tl.maximum(j - 1, 0), num_draft_cols - 1)
                draft = tl.load(drafts_ptr + slot * drafts_stride + col,
                                mask=live & (j > 0) & (j <= num_draft_cols) & (prefill == 0),
                                other=0)
                decode_id = tl.where(j == 0, anchor, draft)
                staged = tl.load(prefill_ids_ptr + offs, mask=live & prefill, other=0)
                tl.store(input_ids_ptr + offs, tl.where(prefill, staged, decode_id), mask=live)
            if row < num_reqs:
                l0 = tl.load(cu_logits_ptr + row).to(tl.int64)
                l1 = tl.load(cu_logits_ptr + row + 1).to(tl.int64)
                for logit_first in range(l0, l1, BLOCK):
                    logit_offs = logit_first + tl.arange(0, BLOCK)
                    tl.store(logits_idx_ptr + logit_offs, end - (l1 - logit_offs),
                             mask=logit_offs < l1)
        else:
            # padding tail: tokens past the last row read token 0 at position 0; rows past the
            # padded batch read length 0
            tail = tl.load(qsl_ptr + num_rows).to(tl.int64)
            for tail_first in range(tail, num_tokens_padded, BLOCK):
                tail_offs = tail_first + tl.arange(0, BLOCK)
                tail_live = tail_offs < num_tokens_padded
                tl.store(positions_ptr + tail_offs, tl.zeros((BLOCK,), tl.int64), mask=tail_live)
                tl.store(input_ids_ptr + tail_offs, tl.zeros((BLOCK,), tl.int64), mask=tail_live)
            for row_first in range(num_rows, max_rows, BLOCK):
                row_offs = row_first + tl.arange(0, BLOCK)
                tl.store(seq_lens_ptr + row_offs,
                         tl.zeros((BLOCK,), tl.int32).to(seq_lens_ptr.dtype.element_ty),
                         mask=row_offs < max_rows)


class PackedStaging:
    """Several small host->device arrays in ONE pinned host buffer and ONE device buffer of the
    same byte layout, so a step moves them all with a single non-blocking copy (each copy launch
    costs the host ~5 us). Every region is a persistent, address-stable view of either side.

    Reuse rule (buffer_utils.py): the host side is rewritten once per step, before that step's
    copy; the previous step's copy has run by then (the step-end synchronisation)."""

    def __init__(self, regions: list[tuple[str, int, torch.dtype]], device: torch.device):
        offsets, total = [], 0
        for _, n, dtype in regions:
            total = -(-total // 8) * 8  # 8-byte aligned regions: every dtype view is legal
            offsets.append(total)
            total += n * torch.empty((), dtype=dtype).element_size()
        self.nbytes = max(-(-total // 8) * 8, 8)
        pin = device.type == "cuda" and torch.cuda.is_available()
        self._host = torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        # On a CPU run the "device" side is a separate tensor too (callers never rely on aliasing).
        self._dev = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        self.cpu: dict[str, torch.Tensor] = {}
        self.np: dict[str, np.ndarray] = {}
        self.gpu: dict[str, torch.Tensor] = {}
        for (name, n, dtype), off in zip(regions, offsets):
            size = n * torch.empty((), dtype=dtype).element_size()
            self.cpu[name] = self._host[off:off + size].view(dtype)
            self.np[name] = self.cpu[name].numpy()
            self.gpu[name] = self._dev[off:off + size].view(dtype)

    def copy_to_gpu(self) -> None:
        self._dev.copy_(self._host, non_blocking=True)


class InputBuffers:
    def __init__(self, max_num_reqs: int, max_num_tokens: int, device: torch.device | str,
                 staged: tuple[tuple[str, int, torch.dtype], ...] = ()):
        """`staged`: extra small per-step arrays (name, length, dtype) that travel in the same
        packed host->device copy as query_start_loc (`self.staging`)."""
        if not isinstance(max_num_reqs, int) or max_num_reqs < 1:
            raise ValueError(f"max_num_reqs={max_num_reqs!r} is invalid: it must be an int >= 1.")
        if not isinstance(max_num_tokens, int) or max_num_tokens < 1:
            raise ValueError(
                f"max_num_tokens={max_num_tokens!r} is invalid: it must be an int >= 1.")
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.device = torch.device(device)

        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=self.device)
        # The host twin is filled first (the scheduler's counts live on the host), then copied
        # over; it lives in a packed pinned buffer with the builder's other per-row arrays.
        self.staging = PackedStaging(
            [("query_start_loc", max_num_reqs + 1, torch.int32), *staged], self.device)
        self.query_start_loc_cpu = self.staging.cpu["query_start_loc"]
        self.query_start_loc_np = self.staging.np["query_start_loc"]  # shares memory
        self.query_start_loc = self.staging.gpu["query_start_loc"]
        # Global lengths (context + current query) and the rank-local lengths under DCP.
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=self.device)
        self.dcp_local_seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=self.device)


@dataclass
class InputBatch:
    """Everything one step needs, built once by the runner (rows: decodes first, then prefills;
    rows [num_reqs, num_reqs_padded) and tokens [num_tokens, num_tokens_padded) are CUDA-graph
    padding: zero-length rows, PAD slots)."""

    req_ids: list[str]
    num_reqs: int
    num_reqs_padded: int
    num_tokens: int
    num_tokens_padded: int
    idx_mapping: torch.Tensor            # [num_reqs_padded] int64 request slot per row
    idx_mapping_np: np.ndarray
    query_start_loc: torch.Tensor        # [num_reqs_padded + 1] int32 device
    query_start_loc_np: np.ndarray       # host twin
    query_start_loc_cpu: torch.Tensor    # same memory as the numpy twin
    seq_lens: torch.Tensor               # [num_reqs_padded] int32 global lengths
    seq_lens_np: np.ndarray              # exact host twin
    num_computed_np: np.ndarray          # [num_reqs] context tokens before this step
    num_scheduled_np: np.ndarray         # [num_reqs] tokens processed this step
    num_draft_np: np.ndarray             # [num_reqs] drafts verified this step
    samples_np: np.ndarray               # [num_reqs] bool: the row samples a token this step
    input_ids: torch.Tensor              # [num_tokens_padded]
    positions: torch.Tensor              # [num_tokens_padded]
    block_tables: tuple[torch.Tensor, ...]   # per KV cache group, [num_reqs_padded, max_blocks]
    slot_mappings: torch.Tensor          # [num_groups, num_tokens_padded]
    logits_indices: torch.Tensor         # [num_logits] token rows whose logits are used
    cu_num_logits_np: np.ndarray         # [num_reqs + 1]
    dcp_local_seq_lens: torch.Tensor | None = None   # [num_reqs_padded] (DCP > 1)
    dcp_local_seq_lens_np: np.ndarray | None = None
    uniform_query_len: int = 0           # Q when every row is a decode row of Q tokens, else 0
    draft_tokens: torch.Tensor | None = None  # [num_reqs_padded, k] drafts being verified
    attn_metadata: dict = field(default_factory=dict)
    cudagraph: bool = False              # replays a captured graph (padded, fixed bounds)

    @property
    def num_logits(self) -> int:
        return int(self.cu_num_logits_np[-1])

    @property
    def num_computed_tokens_cpu(self) -> torch.Tensor:
        return torch.from_numpy(self.num_computed_np.astype(np.int32))


class InputBatchBuilder:
    """Owns the persistent step buffers and builds the InputBatch of every step."""

    def __init__(self, max_num_reqs: int, max_num_tokens: int, device: torch.device,
                 num_spec_tokens: int, dcp_size: int = 1, dcp_rank: int = 0,
                 dcp_interleave: int = 1):
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.device = torch.device(device)
        self.num_spec_tokens = num_spec_tokens
        self.dcp_size, self.dcp_rank, self.dcp_interleave = dcp_size, dcp_rank, dcp_interleave
        R, T = max_num_reqs, max_num_tokens
        # The per-row arrays of a step travel with query_start_loc in ONE packed copy.
        self.buffers = InputBuffers(max_num_reqs, max_num_tokens, self.device, staged=(
            ("idx_mapping", R, torch.int64), ("cu_num_logits", R + 1, torch.int32),
            ("num_computed", R, torch.int32), ("is_prefill_row", R, torch.bool)))
        staging = self.buffers.staging
        self.idx_mapping = _StagedView(staging, "idx_mapping")
        self.is_prefill_row = _StagedView(staging, "is_prefill_row")
        self.cu_num_logits = _StagedView(staging, "cu_num_logits")
        # Context tokens of every batch ROW (not slot): the device preparation reads it per row.
        self.num_computed_rows = _StagedView(staging, "num_computed")
        self.prefill_ids = CpuGpuBuffer(T, dtype=torch.int64, device=self.device)
        self.seq_lens_np = np.zeros(R, dtype=np.int32)
        self.dcp_local_np = np.zeros(R, dtype=np.int32)
        self.logits_indices = torch.zeros(T, dtype=torch.int64, device=self.device)
        self._arange = torch.arange(max(T, R) + 1, dtype=torch.int64, device=self.device)
        # One Triton launch on CUDA; the same logic in torch ops elsewhere.
        self.use_triton = self.device.type == "cuda" and HAS_TRITON
        # Views of the persistent buffers per batch shape (a torch slice costs the host ~1.5 us
        # and a step takes about ten; a steady decode has the same shape every step).
        self._view_cache: dict[tuple[int, int, int, int], tuple] = {}

    def _views(self, B: int, B_pad: int, T_pad: int, num_logits: int) -> tuple:
        key = (B, B_pad, T_pad, num_logits)
        views = self._view_cache.get(key)
        if views is None:
            if len(self._view_cache) >= 256:
                self._view_cache.clear()
            buf = self.buffers
            views = self._view_cache[key] = (
                self.idx_mapping.gpu[:B_pad], buf.query_start_loc[: B_pad + 1],
                self.is_prefill_row.gpu[:B_pad], self.cu_num_logits.gpu[: B + 1],
                buf.positions[:T_pad], buf.seq_lens[:B_pad], self.logits_indices[:num_logits],
                buf.query_start_loc_cpu[: B_pad + 1], buf.input_ids[:T_pad],
                buf.dcp_local_seq_lens[:B_pad])
        return views

    def _prepare_torch(self, requests, idx, qsl, prefill_rows, cu_dev, B, B_pad, T_pad,
                       num_logits_total) -> None:
        buf = self.buffers
        nc_rows = self.num_computed_rows.gpu
        tok = self._arange[:T_pad]
        row = torch.searchsorted(qsl[1:B_pad + 1], tok.to(torch.int32), right=True)
        row = row.clamp(max=max(B_pad - 1, 0))
        in_batch = tok < qsl[B_pad].to(torch.int64)
        offset = tok - qsl[row].to(torch.int64)
        slot = idx[row]
        nc_tok = nc_rows[row].to(torch.int64)
        torch.where(in_batch, nc_tok + offset, torch.zeros_like(nc_tok), out=buf.positions[:T_pad])
        k = requests.draft_tokens.shape[1]
        draft_col = (offset - 1).clamp(0, k - 1)
        decode_ids = torch.where(offset == 0, requests.last_sampled[slot],
                                 requests.draft_tokens[slot, draft_col])
        ids = torch.where(prefill_rows[row], self.prefill_ids.gpu[:T_pad], decode_ids)
        torch.where(in_batch, ids, torch.zeros_like(ids), out=buf.input_ids[:T_pad])
        rows_dev = self._arange[:B_pad]
        nc_row = nc_rows[:B_pad].to(torch.int64)
        qlen = (qsl[1:B_pad + 1] - qsl[:B_pad]).to(torch.int64)
        buf.seq_lens[:B_pad].copy_(torch.where(rows_dev < B, nc_row + qlen,
                                               torch.zeros_like(nc_row)))
        buf.seq_lens[B_pad:].zero_()
        # logits indices: logit l belongs to row r = searchsorted(cu, l); it is the token
        # qsl[r + 1] - (cu[r + 1] - l) (the last num_logits[r] tokens of the row).
        if num_logits_total:
            lidx = self._arange[:num_logits_total]
            lrow = torch.searchsorted(cu_dev[1:], lidx.to(torch.int32), right=True)
            torch.sub(qsl[lrow + 1].to(torch.int64), cu_dev[lrow + 1].to(torch.int64) - lidx,
                      out=self.logits_indices[:num_logits_total])

    def build(self, rows: list, counts: list[int], num_drafts: list[int], samples: list[bool],
              prefill_token_ids: list[list[int] | None], requests, block_tables,
              num_reqs_padded: int | None = None, num_tokens_padded: int | None = None
              ) -> InputBatch:
        """rows: RequestState per batch row (decodes first). counts: tokens scheduled per row.
        num_drafts: drafts verified per decode row (their ids are in requests.draft_tokens).
        samples: whether each row samples this step. prefill_token_ids: the row's input ids for
        prefill rows (None for decode rows, whose ids come from the device state)."""
        B = len(rows)
        B_pad = B if num_reqs_padded is None else num_reqs_padded
        if not B <= B_pad <= self.max_num_reqs:
            raise ValueError(f"{B} rows padded to {B_pad}: need rows <= padded <= "
                             f"max_num_reqs={self.max_num_reqs}")
        buf = self.buffers
        qsl_np = buf.query_start_loc_np
        num_sched = np.array(counts, dtype=np.int64)
        qsl_np[0] = 0
        np.cumsum(num_sched, out=qsl_np[1:B + 1])
        num_tokens = int(qsl_np[B])
        qsl_np[B + 1:B_pad + 1] = num_tokens
        T_pad = num_tokens if num_tokens_padded is None else num_tokens_padded
        if not num_tokens <= T_pad <= self.max_num_tokens:
            raise ValueError(f"{num_tokens} tokens scheduled, more than the runner's buffers hold "
                             f"({self.max_num_tokens}) or the padded size {T_pad}; raise "
                             "max_num_batched_tokens")

        idx_np = self.idx_mapping.np
        idx_np[:B] = [r.slot for r in rows]
        idx_np[B:B_pad] = 0  # padding rows read some valid slot; they have no tokens
        slots = idx_np[:B]
        nc_rows = self.num_computed_rows.np
        np.take(requests.num_computed.np, slots, out=nc_rows[:B])
        nc_rows[B:B_pad] = 0
        num_computed = nc_rows[:B].astype(np.int64)
        seq_np = self.seq_lens_np
        np.add(num_computed, num_sched, out=seq_np[:B], casting="unsafe")
        seq_np[B:B_pad] = 0
        is_prefill = self.is_prefill_row.np
        is_prefill[:B_pad] = False
        # The steady decode step has no prefill row: skip the per-row loop entirely.
        has_prefill = any(map(is_not, prefill_token_ids, repeat(None)))
        if has_prefill:
            pre_ids = self.prefill_ids.np
            for i, ids in enumerate(prefill_token_ids):
                if ids is not None:
                    is_prefill[i] = True
                    pre_ids[qsl_np[i]:qsl_np[i + 1]] = ids
        samples_np = np.array(samples, dtype=bool)
        num_draft_np = np.array(num_drafts, dtype=np.int64)
        # Rows that verify drafts read logits at every position; other sampling rows at the last.
        num_logits = np.where(samples_np, np.where(num_draft_np > 0, num_sched, 1), 0)
        cu = self.cu_num_logits.np
        cu[0] = 0
        np.cumsum(num_logits, out=cu[1:B + 1])
        num_logits_total = int(cu[B])

        # ---- host -> device: ONE packed non-blocking copy (+ the prefill ids), no sync
        buf.staging.copy_to_gpu()
        (idx, qsl, prefill_rows, cu_dev, positions, seq_lens, logits_indices, qsl_cpu,
         input_ids, dcp_local_view) = self._views(B, B_pad, T_pad, num_logits_total)
        if has_prefill:
            self.prefill_ids.copy_to_gpu(num_tokens)

        # ---- device-side preparation from the slot-indexed state
        if self.use_triton:
            _prepare_inputs_kernel[(B_pad + 1,)](
                buf.input_ids, buf.positions, buf.seq_lens, self.logits_indices,
                qsl, idx, prefill_rows, self.prefill_ids.gpu, cu_dev,
                self.num_computed_rows.gpu, requests.last_sampled, requests.draft_tokens,
                requests.draft_tokens.stride(0), requests.draft_tokens.shape[1], B, B_pad, T_pad,
                self.max_num_reqs, BLOCK=128)
        else:
            self._prepare_torch(requests, idx, qsl, prefill_rows, cu_dev, B, B_pad, T_pad,
                                num_logits_total)
        dcp_local = dcp_local_np = None
        if self.dcp_size > 1:
            prepare_dcp_local_seq_lens(buf.dcp_local_seq_lens, buf.seq_lens, B, self.dcp_size,
                                       self.dcp_rank, self.dcp_interleave)
            dcp_local = dcp_local_view
            dcp_local_np = self.dcp_local_np
            # a zero-copy view: the formula does not keep its input
            dcp_local_np[:B_pad] = get_dcp_local_seq_lens(
                torch.from_numpy(seq_np[:B_pad]), self.dcp_size, self.dcp_rank,
                self.dcp_interleave).numpy()
        tables = block_tables.gather_block_tables(idx, idx_np[:B_pad])
        slot_mappings = block_tables.compute_slot_mappings(qsl, positions)

        uniform = 0
        if B > 0 and not has_prefill:
            q = counts[0]
            if counts.count(q) == B and all(samples):
                uniform = int(q)
        return InputBatch(
            req_ids=[r.req_id for r in rows], num_reqs=B, num_reqs_padded=B_pad,
            num_tokens=num_tokens, num_tokens_padded=T_pad, idx_mapping=idx,
            idx_mapping_np=idx_np[:B_pad], query_start_loc=qsl,
            query_start_loc_np=qsl_np[: B_pad + 1],
            query_start_loc_cpu=qsl_cpu, seq_lens=seq_lens,
            seq_lens_np=seq_np[:B_pad], num_computed_np=num_computed, num_scheduled_np=num_sched,
            num_draft_np=num_draft_np, samples_np=samples_np, input_ids=input_ids,
            positions=positions, block_tables=tables, slot_mappings=slot_mappings,
            logits_indices=logits_indices, cu_num_logits_np=cu[: B + 1].copy(),
            dcp_local_seq_lens=dcp_local,
            dcp_local_seq_lens_np=None if dcp_local_np is None else dcp_local_np[:B_pad],
            uniform_query_len=uniform, draft_tokens=requests.draft_tokens)


class _StagedView:
    """CpuGpuBuffer-shaped handle (`.cpu`, `.np`, `.gpu`) on one region of a PackedStaging."""

    def __init__(self, staging: PackedStaging, name: str):
        self.cpu, self.np, self.gpu = staging.cpu[name], staging.np[name], staging.gpu[name]
