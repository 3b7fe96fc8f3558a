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

import numpy as np
import torch

from vllm.v1.worker.gpu.buffer_utils import CpuGpuBuffer
from vllm.v1.worker.gpu.cp_utils import HAS_TRITON, _check_geometry
from vllm.v1.worker.gpu.prepare_step import (
    StepPrepBuffers,
    prepare_step_torch,
    prepare_step_triton,
)

# Up to this many deferred block-table writes in a step, every batch row scans all of them in the
# fused preparation (InputBatchBuilder.build says why); more (an admission's whole table) get
# per-row ranges. The same bound as BlockTables' scalar patch path.
_WHOLE_RANGE_PATCHES = 16


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
    # [num_reqs + 1] int32 device twin of cu_num_logits_np (a view of the staging buffer: valid
    # until the next build); the eager greedy verification reads each row's logits range there
    cu_num_logits: torch.Tensor | None = None
    attn_metadata: dict = field(default_factory=dict)
    cudagraph: bool = False              # replays a captured graph (padded, fixed bounds)

    @property
    def num_logits(self) -> int:
        return int(self.cu_num_logits_np[-1])

    @property
    def num_computed_tokens_cpu(self) -> torch.Tensor:
        return torch.from_numpy(self.num_computed_np.astype(np.int32))


class InputBatchBuilder:
    """Owns the persistent step buffers and builds the InputBatch of every step.

    Per step: the host lays out the rows into ONE packed pinned buffer (query_start_loc, slots,
    context lengths, prefill flags, cumulative logits, block-table refresh flags), ONE
    non-blocking copy moves it (+ the staged prefill ids when a prefill row exists), and ONE
    launch (`prepare_step.py`: Triton on CUDA, its torch twin elsewhere) writes input ids,
    positions, seq_lens, DCP-local lengths, logits indices, the changed block-table rows and the
    slot mappings of every group. A steady decode step (the same uniform shape as the step
    before) rewrites only the slots and context lengths on the host."""

    # Staged block-table cell writes per request slot and step (a steady step appends at most
    # one block per row and group).
    MAX_PATCHES_PER_ROW = 4

    def __init__(self, max_num_reqs: int, max_num_tokens: int, device: torch.device,
                 num_spec_tokens: int, dcp_size: int = 1, dcp_rank: int = 0,
                 dcp_interleave: int = 1):
        _check_geometry(dcp_size, dcp_rank, dcp_interleave)
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.device = torch.device(device)
        self.num_spec_tokens = num_spec_tokens
        self.dcp_size, self.dcp_rank, self.dcp_interleave = dcp_size, dcp_rank, dcp_interleave
        R, T = max_num_reqs, max_num_tokens
        # The per-row arrays of a step travel with query_start_loc in ONE packed copy.
        self.buffers = InputBuffers(max_num_reqs, max_num_tokens, self.device, staged=(
            ("idx_mapping", R, torch.int64), ("cu_num_logits", R + 1, torch.int32),
            ("num_computed", R, torch.int32), ("is_prefill_row", R, torch.bool),
            ("refresh_rows", R, torch.bool), ("patch_lo", R, torch.int32),
            ("patch_hi", R, torch.int32), ("patch_keys", self.MAX_PATCHES_PER_ROW * R, torch.int64),
            ("patch_values", self.MAX_PATCHES_PER_ROW * R, torch.int32)))
        staging = self.buffers.staging
        self.idx_mapping = _StagedView(staging, "idx_mapping")
        self.is_prefill_row = _StagedView(staging, "is_prefill_row")
        self.cu_num_logits = _StagedView(staging, "cu_num_logits")
        # Context tokens of every batch ROW (not slot): the device preparation reads it per row.
        self.num_computed_rows = _StagedView(staging, "num_computed")
        # Rows whose batch-order block tables the preparation re-gathers (BlockTables.gather_host).
        self.refresh_rows = _StagedView(staging, "refresh_rows")
        # Deferred block-table writes (BlockTables.take_patches) travel in the same copy; more
        # than fit (a long prompt admitted) are copied directly by the tables instead.
        self.patch_lo = _StagedView(staging, "patch_lo")
        self.patch_hi = _StagedView(staging, "patch_hi")
        self.patch_keys = _StagedView(staging, "patch_keys")
        self.patch_values = _StagedView(staging, "patch_values")
        # What patch_lo / patch_hi hold from a previous step: None (zeros), "whole" (lo 0, hi
        # its patch count) or "ranges" (each row's own patches, binary-searched).
        self._patched: str | None = None
        self.prefill_ids = CpuGpuBuffer(T, dtype=torch.int64, device=self.device)
        self.seq_lens_np = np.zeros(R, dtype=np.int32)
        self.dcp_local_np = np.zeros(R, dtype=np.int32)
        self.logits_indices = torch.zeros(T, dtype=torch.int64, device=self.device)
        # One Triton launch on CUDA; its torch twin elsewhere.
        self.use_triton = self.device.type == "cuda" and HAS_TRITON
        # Views of the persistent buffers per batch shape (a torch slice costs the host ~1.5 us
        # and a step takes about ten; a steady decode has the same shape every step).
        self._view_cache: dict[tuple[int, int, int, int], tuple] = {}
        # The fused preparation's buffers, per (RequestStates, BlockTables) pair (made once).
        self._prep: tuple[object, object, StepPrepBuffers] | None = None
        # Steady-shape cache: the uniform layout (B, B_pad, T_pad, q, drafts) whose
        # query_start_loc / cu_num_logits / prefill flags the staging buffer holds now, and the
        # (read-only) per-row arrays of that layout. Only build writes those staging regions,
        # so while the key matches they are current (a different layout resets the key).
        self._uniform_key: tuple | None = None
        self._uniform_arrays: tuple | None = None
        self._ones_cache: dict[int, np.ndarray] = {}

    def _views(self, B: int, B_pad: int, T_pad: int, num_logits: int) -> tuple:
        key = (B, B_pad, T_pad, num_logits)
        views = self._view_cache.get(key)
        if views is None:
            if len(self._view_cache) >= 256:
                self._view_cache.clear()
            buf = self.buffers
            views = self._view_cache[key] = (
                self.idx_mapping.gpu[:B_pad], buf.query_start_loc[: B_pad + 1],
                buf.positions[:T_pad], buf.seq_lens[:B_pad], self.logits_indices[:num_logits],
                buf.query_start_loc_cpu[: B_pad + 1], buf.input_ids[:T_pad],
                buf.dcp_local_seq_lens[:B_pad], self.buffers.query_start_loc_np[: B_pad + 1],
                self.idx_mapping.np[:B_pad], self.seq_lens_np[:B_pad],
                self.dcp_local_np[:B_pad])
        return views

    def _prep_buffers(self, requests, block_tables) -> StepPrepBuffers:
        prep = self._prep
        if prep is not None and prep[0] is requests and prep[1] is block_tables:
            return prep[2]
        buf = self.buffers
        bt = block_tables
        if bt.cp_size != self.dcp_size or bt.cp_rank != self.dcp_rank \
                or bt.cp_interleave != self.dcp_interleave:
            raise ValueError(
                f"block tables have DCP geometry (size {bt.cp_size}, rank {bt.cp_rank}, interleave "
                f"{bt.cp_interleave}) but the input batch builder has ({self.dcp_size}, "
                f"{self.dcp_rank}, {self.dcp_interleave}); build both from the same config.")
        if bt.max_num_reqs < self.max_num_reqs or bt.max_num_batched_tokens < self.max_num_tokens:
            raise ValueError(
                f"block tables hold {bt.max_num_reqs} rows x {bt.max_num_batched_tokens} tokens, "
                f"fewer than the builder's {self.max_num_reqs} x {self.max_num_tokens}; size the "
                "BlockTables with the runner's max_num_reqs and max_num_tokens.")
        b = StepPrepBuffers(
            input_ids=buf.input_ids, positions=buf.positions, seq_lens=buf.seq_lens,
            logits_indices=self.logits_indices, dcp_local_seq_lens=buf.dcp_local_seq_lens,
            slot_mappings=bt.slot_mappings, input_tables=bt._input_block_tables,
            query_start_loc=buf.query_start_loc, idx_mapping=self.idx_mapping.gpu,
            is_prefill=self.is_prefill_row.gpu, prefill_ids=self.prefill_ids.gpu,
            cu_num_logits=self.cu_num_logits.gpu, num_computed=self.num_computed_rows.gpu,
            refresh=self.refresh_rows.gpu, patch_keys=self.patch_keys.gpu,
            patch_values=self.patch_values.gpu, patch_lo=self.patch_lo.gpu,
            patch_hi=self.patch_hi.gpu, last_sampled=requests.last_sampled,
            draft_tokens=requests.draft_tokens, tables=bt._block_tables,
            block_sizes=bt._block_sizes, group_cp_sizes=bt._group_cp_sizes,
            group_max_blocks=bt._group_max_blocks, block_sizes_host=tuple(bt.block_sizes),
            group_cp_sizes_host=bt.group_cp_sizes, group_max_blocks_host=bt.group_max_blocks)
        self._prep = (requests, block_tables, b)
        return b

    def _layout_general(self, counts, num_drafts, samples, prefill_token_ids, B, B_pad):
        """Host layout of any step: query_start_loc, prefill flags and ids, logits counts.
        Returns (num_sched, num_draft_np, samples_np, has_prefill)."""
        buf = self.buffers
        qsl_np = buf.query_start_loc_np
        num_sched = np.array(counts, dtype=np.int64)
        qsl_np[0] = 0
        np.cumsum(num_sched, out=qsl_np[1:B + 1])
        qsl_np[B + 1:B_pad + 1] = qsl_np[B]
        is_prefill = self.is_prefill_row.np
        is_prefill[:B_pad] = False
        has_prefill = prefill_token_ids.count(None) != B
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
        return num_sched, num_draft_np, samples_np, has_prefill

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
        # ---- host layout. A uniform step (every row q tokens with d drafts, samples, no
        # prefill) of the same shape as the last uniform build reuses its staged layout.
        q = counts[0] if B else 0
        d = num_drafts[0] if B else 0
        uniform_rows = (B > 0 and counts.count(q) == B and num_drafts.count(d) == B
                        and samples.count(True) == B and prefill_token_ids.count(None) == B)
        if uniform_rows:
            T = B * q
            T_pad = T if num_tokens_padded is None else num_tokens_padded
            key = (B, B_pad, T_pad, q, d)
            if key == self._uniform_key:
                num_sched, num_draft_np, samples_np, cu_np = self._uniform_arrays
            else:
                num_sched, num_draft_np, samples_np, _ = self._layout_general(
                    counts, num_drafts, samples, prefill_token_ids, B, B_pad)
                cu_np = self.cu_num_logits.np[: B + 1].copy()
                for a in (num_sched, num_draft_np, samples_np, cu_np):
                    a.flags.writeable = False  # shared by every step of this shape
                self._uniform_key = key
                self._uniform_arrays = (num_sched, num_draft_np, samples_np, cu_np)
            num_logits_total = int(cu_np[B])
            has_prefill = False
            num_tokens = T
        else:
            self._uniform_key = None  # the staging regions now hold another layout
            num_sched, num_draft_np, samples_np, has_prefill = self._layout_general(
                counts, num_drafts, samples, prefill_token_ids, B, B_pad)
            num_tokens = int(buf.query_start_loc_np[B])
            cu_np = self.cu_num_logits.np[: B + 1].copy()
            num_logits_total = int(cu_np[B])
            T_pad = num_tokens if num_tokens_padded is None else num_tokens_padded
        if not num_tokens <= T_pad <= self.max_num_tokens:
            self._uniform_key = None
            raise ValueError(f"{num_tokens} tokens scheduled, more than the runner's buffers hold "
                             f"({self.max_num_tokens}) or the padded size {T_pad}; raise "
                             "max_num_batched_tokens")
        (idx, qsl, positions, seq_lens, logits_indices, qsl_cpu, input_ids, dcp_local_view,
         qsl_np, idx_np, seq_np, dcp_np) = self._views(B, B_pad, T_pad, num_logits_total)

        idx_np[:B] = [r.slot for r in rows]
        idx_np[B:] = 0  # padding rows read some valid slot; they have no tokens
        slots = idx_np[:B]
        nc_rows = self.num_computed_rows.np
        np.take(requests.num_computed.np, slots, out=nc_rows[:B])
        nc_rows[B:B_pad] = 0
        num_computed = nc_rows[:B].astype(np.int64)
        np.add(num_computed, num_sched, out=seq_np[:B], casting="unsafe")
        seq_np[B:] = 0
        # Host twin of the batch-order block tables; the rows it re-gathered are flagged for
        # the device (the fused preparation copies exactly those).
        block_tables.gather_host(idx_np, self.refresh_rows.np)
        # Block ids appended since the last step reach the device in this step's one copy; each
        # row learns the range of its slot's patches (sorted keys, slot-major).
        num_patches = block_tables.take_patches(self.patch_keys.np, self.patch_values.np)
        if num_patches and num_patches <= _WHOLE_RANGE_PATCHES:
            # A few patches (requests crossing into a new block): every row scans all of them.
            # The kernel applies a patch only where its cell is one of the row's own (the key
            # less the row's first cell must be a column of the row's table), so a range that
            # holds other slots' patches too changes nothing, and this costs the host one fill
            # instead of two binary searches and their arrays. Drifted batches (requests crossing
            # blocks in different steps) take this path in about half their steps.
            if self._patched == "ranges":
                self.patch_lo.np[:] = 0
            self.patch_hi.np[:B_pad] = num_patches
            self._patched = "whole"
        elif num_patches:
            keys = self.patch_keys.np[:num_patches]
            first = idx_np * block_tables._cells_per_slot
            # (the method, not np.searchsorted: its dispatch wrapper costs a few us a call)
            self.patch_lo.np[:B_pad] = keys.searchsorted(first)
            first += block_tables._cells_per_slot
            self.patch_hi.np[:B_pad] = keys.searchsorted(first)
            self._patched = "ranges"
        elif self._patched:
            if self._patched == "ranges":
                self.patch_lo.np[:] = 0
            self.patch_hi.np[:] = 0  # (patch_lo is 0 after "whole")
            self._patched = None

        # ---- host -> device: ONE packed non-blocking copy (+ the prefill ids), no sync
        buf.staging.copy_to_gpu()
        if has_prefill:
            self.prefill_ids.copy_to_gpu(num_tokens)

        # ---- device-side preparation: one launch
        prep = self._prep_buffers(requests, block_tables)
        if self.use_triton:
            prepare_step_triton(prep, B, B_pad, T_pad, self.dcp_size, self.dcp_rank,
                                self.dcp_interleave, num_patches)
        else:
            self._prepare_torch(prep, B, B_pad, T_pad, num_logits_total, num_patches)
        tables = block_tables.gathered_rows(B_pad)
        slot_mappings = block_tables.slot_mapping_view(T_pad)
        dcp_local = dcp_local_np = None
        if self.dcp_size > 1:
            dcp_local = dcp_local_view
            dcp_local_np = dcp_np
            # the host twin of the same formula (numpy, int64 intermediates)
            span = self.dcp_size * self.dcp_interleave
            seq64 = seq_np.astype(np.int64)
            rounds = seq64 // span
            part = np.clip(seq64 - rounds * span - self.dcp_rank * self.dcp_interleave, 0,
                           self.dcp_interleave)
            np.add(rounds * self.dcp_interleave, part, out=dcp_np, casting="unsafe")

        # Q when every row is a sampling decode row of Q tokens (drafts may differ per row only
        # in a caller's test layout; the runner's verify rows are 1 + k each).
        uniform = int(q) if uniform_rows or (
            B > 0 and not has_prefill and counts.count(q) == B and samples.count(True) == B) else 0
        return InputBatch(
            req_ids=[r.req_id for r in rows], num_reqs=B, num_reqs_padded=B_pad,
            num_tokens=num_tokens, num_tokens_padded=T_pad, idx_mapping=idx,
            idx_mapping_np=idx_np, query_start_loc=qsl,
            query_start_loc_np=qsl_np,
            query_start_loc_cpu=qsl_cpu, seq_lens=seq_lens,
            seq_lens_np=seq_np, num_computed_np=num_computed, num_scheduled_np=num_sched,
            num_draft_np=num_draft_np, samples_np=samples_np, input_ids=input_ids,
            positions=positions, block_tables=tables, slot_mappings=slot_mappings,
            logits_indices=logits_indices, cu_num_logits_np=cu_np,
            dcp_local_seq_lens=dcp_local, dcp_local_seq_lens_np=dcp_local_np,
            uniform_query_len=uniform, draft_tokens=requests.draft_tokens,
            cu_num_logits=self.cu_num_logits.gpu)

    def _prepare_torch(self, prep, B, B_pad, T_pad, num_logits_total, num_patches) -> None:
        """The CPU path: the fused kernel's torch twin (a method so host-cost benchmarks can
        stand in for the one CUDA launch)."""
        prepare_step_torch(prep, B, B_pad, T_pad, self.dcp_size, self.dcp_rank,
                           self.dcp_interleave, num_logits_total, num_patches)


class _StagedView:
    """CpuGpuBuffer-shaped handle (`.cpu`, `.np`, `.gpu`) on one region of a PackedStaging."""

    def __init__(self, staging: PackedStaging, name: str):
        self.cpu, self.np, self.gpu = staging.cpu[name], staging.np[name], staging.gpu[name]
