"""Per-KV-cache-group block tables and slot mappings, DCP aware.

Layout (all persistent, allocated once):
  - `block_tables[g]`       [max_num_reqs, max_num_blocks_per_req] int32, row = persistent request slot;
  - `input_block_tables[g]` same shape; rows [0, num_reqs) hold the rows of this step's batch, in
    batch order (filled by `gather_block_tables`);
  - `slot_mappings`         [num_groups, max_num_batched_tokens] int64 (-1 = PAD: not stored here).

Under DCP (DESIGN §2) a block id covers a virtual block of block_size * cp_size global tokens; every
rank uses the same block ids and stores only the tokens it owns, so slot mappings are rank specific.
A REPLICATED group (`dcp_sharded[g]` False: a non-DCP drafter under a DCP target) keeps the whole
virtual block on every rank: its table expands block id b into the cp_size pages
b*cp_size .. b*cp_size + cp_size - 1 of its own (cp_size times larger) cache, and its slots follow
the single-rank formula, identical on every rank. Each group thus has its own sharding and its own
block count; the scheduler still hands out one list of block ids per request.
On CUDA slot mappings come from a Triton kernel (no host sync, capturable); elsewhere from torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm.v1.worker.gpu.cp_utils import HAS_TRITON, _check_geometry, _slot_geometry
if HAS_TRITON:
    from vllm.v1.worker.gpu.cp_utils import slot_geometry_tl

if HAS_TRITON:
    import triton
    import triton.language as tl

PAD_SLOT_ID = -1
# gather_block_tables: below this many host table entries a changed batch is re-gathered whole
# (one numpy op); above it only the changed rows are copied. Measured on the CPU (one group, 513
# entries a row, a few rows changed per step): whole 7/10/15 us at 8/32/64 rows, changed rows
# only 7/8/9 us -- so only tiny tables take the whole copy.
_FULL_REGATHER_ENTRIES = 1 << 11
# take_patches: up to this many pending one-cell ranges take the scalar path.
_SCALAR_PATCHES = 16
# gather_host: up to this many changed rows are copied one by one (a basic-slice copy each,
# ~0.4 us on the 2-core CPU box, where the whole-batch fancy-index gather costs ~1.7 us and a
# fancy-index copy of the rows ~2.9 us).
_ROW_BY_ROW = 2


if HAS_TRITON:

    # Per-step counts are not specialised on (one compiled variant, no JIT mid-serving).
    @triton.jit(do_not_specialize=["num_reqs", "num_tokens"])
    def _compute_slot_mappings_kernel(
        slot_mappings_ptr,  # [num_groups, slot_stride] int64
        slot_stride,
        block_tables_ptr,  # [num_groups, max_num_reqs, max_blocks] int32 (gathered rows)
        table_group_stride,
        table_row_stride,
        block_sizes_ptr,  # [num_groups] int32
        group_cp_sizes_ptr,  # [num_groups] int32: cp_size (sharded) or 1 (replicated)
        group_max_blocks_ptr,  # [num_groups] int32: table entries of a row in that group
        query_start_loc_ptr,  # [num_reqs + 1]
        positions_ptr,  # [num_tokens]
        num_reqs,
        num_tokens,
        cp_rank,
        cp_interleave,
        BLOCK: tl.constexpr,
    ):
        group = tl.program_id(0)
        row = tl.program_id(1)
        out_ptr = slot_mappings_ptr + group * slot_stride
        if row == num_reqs:
            # The extra program PADs the tail tokens that belong to no request (graph padding).
            start = tl.load(query_start_loc_ptr + num_reqs).to(tl.int64)
            for first in range(start, num_tokens, BLOCK):
                offs = first + tl.arange(0, BLOCK)
                tl.store(out_ptr + offs, tl.full((BLOCK,), -1, tl.int64), mask=offs < num_tokens)
        else:
            block_size = tl.load(block_sizes_ptr + group).to(tl.int64)
            # A replicated group is a one-rank group: it owns every token (rank 0 of 1).
            group_cp = tl.load(group_cp_sizes_ptr + group).to(tl.int64)
            group_rank = tl.where(group_cp == 1, 0, cp_rank)
            max_blocks = tl.load(group_max_blocks_ptr + group).to(tl.int64)
            table_row_ptr = block_tables_ptr + group * table_group_stride + row * table_row_stride
            start = tl.load(query_start_loc_ptr + row).to(tl.int64)
            end = tl.load(query_start_loc_ptr + row + 1).to(tl.int64)
            for first in range(start, end, BLOCK):
                offs = first + tl.arange(0, BLOCK)
                in_row = offs < end
                pos = tl.load(positions_ptr + offs, mask=in_row, other=0).to(tl.int64)
                block_index, owned, local_offset = slot_geometry_tl(
                    pos, block_size, group_cp, group_rank, cp_interleave)
                # Out-of-table positions (a caller bug; the torch path raises) become PAD rather
                # than overwriting block 0, which may belong to another request.
                readable = in_row & (pos >= 0) & (block_index < max_blocks)
                block_id = tl.load(table_row_ptr + block_index, mask=readable, other=0).to(tl.int64)
                slot = tl.where(owned & readable, block_id * block_size + local_offset, -1)
                tl.store(out_ptr + offs, slot, mask=in_row)


@dataclass(frozen=True)
class SlotGeometry:
    """The persistent device tensors a fused kernel reads to compute slots in-line, with the
    formula of `_compute_slot_mappings_kernel` (e.g. the block drafters' one-launch input write)."""

    slot_mappings: torch.Tensor       # [num_groups, max_num_batched_tokens] int64 (written)
    input_block_tables: torch.Tensor  # [num_groups, max_num_reqs, max_blocks] int32 (batch rows)
    block_sizes: torch.Tensor         # [num_groups] int32
    group_cp_sizes: torch.Tensor      # [num_groups] int32: cp_size (sharded) or 1 (replicated)
    group_max_blocks: torch.Tensor    # [num_groups] int32: table entries of a row
    cp_rank: int
    cp_interleave: int


class BlockTables:
    def __init__(self, block_sizes: list[int], max_num_reqs: int, max_num_blocks_per_req: int,
                 max_num_batched_tokens: int, device: torch.device | str, cp_size: int = 1,
                 cp_rank: int = 0, cp_interleave: int = 1,
                 dcp_sharded: list[bool] | tuple[bool, ...] | None = None):
        _check_geometry(cp_size, cp_rank, cp_interleave)
        if len(block_sizes) == 0:
            raise ValueError("block_sizes is empty: pass one block size per KV cache group.")
        if dcp_sharded is None:
            dcp_sharded = [True] * len(block_sizes)
        if len(dcp_sharded) != len(block_sizes) or not all(isinstance(f, bool)
                                                           for f in dcp_sharded):
            raise ValueError(f"dcp_sharded={dcp_sharded!r} is invalid: pass one bool per KV cache "
                             f"group ({len(block_sizes)} groups).")
        for block_size in block_sizes:
            if not isinstance(block_size, int) or block_size < 1 or block_size % cp_interleave:
                raise ValueError(
                    f"block size {block_size!r} is invalid: it must be a positive multiple of "
                    f"cp_interleave={cp_interleave}.")
        for name, value in (("max_num_reqs", max_num_reqs),
                            ("max_num_blocks_per_req", max_num_blocks_per_req),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: it must be an int >= 1.")
        self.block_sizes = list(block_sizes)
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.max_num_batched_tokens = max_num_batched_tokens
        self.device = torch.device(device)
        # The ENGINE's DCP geometry (the target's). A group's own sharding is group_cp_sizes[g]:
        # speculators must not read cp_size as their own DCP size.
        self.cp_size = cp_size
        self.cp_rank = cp_rank
        self.cp_interleave = cp_interleave
        self.dcp_sharded = tuple(dcp_sharded)
        self.group_cp_sizes = tuple(cp_size if f else 1 for f in dcp_sharded)
        self.group_cp_ranks = tuple(cp_rank if f else 0 for f in dcp_sharded)
        # Pages per block id: a replicated group expands every id into cp_size pages.
        self.pages_per_block_id = tuple(1 if f else cp_size for f in dcp_sharded)
        self.group_max_blocks = tuple(max_num_blocks_per_req * e for e in self.pages_per_block_id)

        num_groups = len(block_sizes)
        table_shape = (num_groups, max_num_reqs, max(self.group_max_blocks))
        # One tensor per kind, so the slot-mapping kernel reaches every group through strides.
        self._block_tables = torch.zeros(table_shape, dtype=torch.int32, device=self.device)
        # Pinned host twin of every table: appends are written here and copied over without a
        # host sync, and host planners (FlashInfer plan) read block ids from here, never from
        # the device.
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        self._host_tables = torch.zeros(table_shape, dtype=torch.int32, pin_memory=pin)
        self.host_block_tables = self._host_tables.numpy()
        # Host twin of the gathered (batch-order) rows, for host planners.
        self._input_host = torch.zeros(table_shape, dtype=torch.int32)
        self.input_block_tables_cpu = tuple(self._input_host[g] for g in range(num_groups))
        self._input_host_np = self._input_host.numpy()
        # The pages each gathered row holds (num_blocks of its slot), gathered with the host
        # twin: a planner may list pages past a request's length up to these (the FlashInfer
        # page-list lookahead), never past them.
        self._input_num_blocks = np.zeros((num_groups, max_num_reqs), dtype=np.int32)
        self.input_num_blocks_cpu = tuple(self._input_num_blocks[g] for g in range(num_groups))
        self._input_block_tables = torch.zeros(table_shape, dtype=torch.int32, device=self.device)
        self.block_tables = tuple(self._block_tables[g] for g in range(num_groups))
        self.input_block_tables = tuple(self._input_block_tables[g] for g in range(num_groups))
        self.num_blocks = np.zeros((num_groups, max_num_reqs), dtype=np.int32)  # host-side counts
        self._block_sizes = torch.tensor(block_sizes, dtype=torch.int32, device=self.device)
        self._group_cp_sizes = torch.tensor(self.group_cp_sizes, dtype=torch.int32,
                                            device=self.device)
        self._group_max_blocks = torch.tensor(self.group_max_blocks, dtype=torch.int32,
                                              device=self.device)
        self.slot_mappings = torch.full((num_groups, max_num_batched_tokens), PAD_SLOT_ID,
                                        dtype=torch.int64, device=self.device)
        self._num_gathered_reqs = 0
        # Skip-if-unchanged state of gather_block_tables: the slots of the gathered rows
        # (None: nothing known), the slots whose blocks changed since they were last gathered,
        # and the slots changed since the last gather (empty: nothing to check). A drifted batch
        # (requests crossing block boundaries in different steps) changes one or two slots in
        # about half its steps; `_rows_of_slot` (the held rows of each slot) turns that into a
        # few scalar operations instead of a masked pass over the batch.
        self._held_slots: bytes | None = None  # bytes of the int64 slots: a cheap comparison
        self._slot_dirty = np.ones(max_num_reqs, dtype=bool)
        self._changed_since_gather: list[int] = []
        self._rows_of_slot: dict[int, list[int]] = {}
        # Host table ranges (group, slot, start, end) written since the device tables were last
        # brought up to date (append_block_ids defers its device copy).
        self._pending: list[tuple[int, int, int, int]] = []
        self._cells_per_slot = num_groups * table_shape[2]
        # Views handed out per batch size (a torch slice costs the host ~1.5 us per call).
        self._row_views: dict[int, tuple[torch.Tensor, ...]] = {}
        self._slot_views: dict[int, torch.Tensor] = {}

    @property
    def num_kv_cache_groups(self) -> int:
        return len(self.block_sizes)

    def _check_req_index(self, req_index: int) -> None:
        if not isinstance(req_index, (int, np.integer)) or not 0 <= req_index < self.max_num_reqs:
            raise ValueError(
                f"req_index={req_index!r} is invalid: it must be in [0, {self.max_num_reqs}).")

    def append_block_ids(self, req_index: int, block_ids: tuple[list[int], ...],
                         overwrite: bool) -> None:
        """Append (or, with overwrite, replace) the block ids of one request, one list per group.
        Ids are the scheduler's (virtual) block ids; a replicated group stores their expansion
        into its own pages."""
        self._check_req_index(req_index)
        if len(block_ids) != self.num_kv_cache_groups:
            raise ValueError(
                f"got block ids for {len(block_ids)} groups, expected {self.num_kv_cache_groups} "
                "(one list per KV cache group).")
        for group, ids in enumerate(block_ids):
            pages = self.pages_per_block_id[group]
            if pages > 1 and len(ids) > 0:
                ids = (np.asarray(ids, dtype=np.int64)[:, None] * pages
                       + np.arange(pages, dtype=np.int64)).reshape(-1)
            start = 0 if overwrite else int(self.num_blocks[group, req_index])
            end = start + len(ids)
            if end > self.group_max_blocks[group]:
                raise ValueError(
                    f"request slot {req_index} would hold {end // pages} blocks in group {group}, "
                    f"more than max_num_blocks_per_req={self.max_num_blocks_per_req}; raise "
                    "max_model_len headroom or shorten the request.")
            self._slot_dirty[req_index] = True
            self._changed_since_gather.append(req_index)
            if len(ids) > 0:
                self.host_block_tables[group, req_index, start:end] = ids
                # The device copy is deferred: the next step preparation carries the new
                # entries in its one staged copy (take_patches), or flush_device_tables copies
                # them (one H2D copy per range) before any other device read of the tables.
                self._pending.append((group, req_index, start, end))
            self.num_blocks[group, req_index] = end

    def flush_device_tables(self) -> None:
        """Copy every deferred host write to the slot-indexed device tables (non-blocking, from
        the pinned twin, one copy per range). The values copied are the host's at copy time."""
        for group, slot, start, end in self._pending:
            self.block_tables[group][slot, start:end].copy_(
                self._host_tables[group, slot, start:end], non_blocking=True)
        self._pending.clear()

    def take_patches(self, keys_out: np.ndarray, values_out: np.ndarray) -> int:
        """Hand the deferred host writes to the fused step preparation as cell patches: sorted
        keys slot * (groups * cols) + group * cols + col and their CURRENT host values, written
        into the staged arrays; returns how many. When they do not fit, they are flushed with
        direct copies instead (returns 0). Either way nothing stays pending."""
        pending = self._pending
        if not pending:
            return 0
        if len(pending) <= _SCALAR_PATCHES and len(pending) <= keys_out.shape[0]:
            # The steady case (a few requests crossed into a new block, one cell each): Python
            # scalars cost ~3 us where the numpy pass below costs ~25 (2-core CPU box).
            C = self._host_tables.shape[2]
            cps = self._cells_per_slot
            cells = []
            for group, slot, start, end in pending:
                if end - start != 1:
                    break
                cells.append((slot * cps + group * C + start, group, slot, start))
            else:
                pending.clear()
                cells.sort()
                host = self.host_block_tables
                for i, (key, group, slot, col) in enumerate(cells):
                    keys_out[i] = key
                    values_out[i] = host[group, slot, col]
                return len(cells)
        # One numpy pass over all pending ranges (no Python work per cell): the run of cells
        # [start, end) of range i becomes keys key0[i] + 0 .. len[i]-1.
        ranges = np.array(pending, dtype=np.int64)
        pending.clear()
        group, slot, start, end = ranges.T
        lengths = end - start
        total = int(lengths.sum())
        if total > keys_out.shape[0]:
            for g, r, a, b in ranges.tolist():  # too many for the staging: direct copies
                self.block_tables[g][r, a:b].copy_(self._host_tables[g, r, a:b],
                                                   non_blocking=True)
            return 0
        _, R, C = self._host_tables.shape
        key0 = slot * self._cells_per_slot + group * C + start
        flat0 = (group * R + slot) * C + start  # the same cell in the host table's memory
        if total == len(ranges):  # the steady case: one cell per range
            keys, flat = key0, flat0
        else:
            within = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            keys = np.repeat(key0, lengths) + within
            flat = np.repeat(flat0, lengths) + within
        order = np.argsort(keys, kind="stable")
        keys_out[:total] = keys[order]
        values_out[:total] = self.host_block_tables.reshape(-1)[flat[order]]
        return total

    def remove_request(self, req_index: int) -> None:
        self._check_req_index(req_index)
        self.num_blocks[:, req_index] = 0
        self._slot_dirty[req_index] = True
        self._changed_since_gather.append(req_index)

    def gather_block_tables(self, idx_mapping: torch.Tensor,
                            idx_mapping_np=None) -> tuple[torch.Tensor, ...]:
        """Copy the rows of this step's requests (idx_mapping[i] = slot of batch row i) into the
        persistent input tables; returns one [num_reqs, max_blocks] view per group. With the host
        slots `idx_mapping_np`, the host twin `input_block_tables_cpu` is gathered too, and only
        where it changed: a row is copied again when its slot differs from the one it holds or
        that slot's blocks changed (append_block_ids / remove_request) since; when no row
        changed, the device gather is skipped as well (its rows are then already current)."""
        num_reqs = idx_mapping.shape[0]
        if idx_mapping.device.type != self.device.type:
            raise ValueError(f"idx_mapping is on {idx_mapping.device}; pass the device copy "
                             f"({self.device}) so the gather needs no host transfer.")
        if num_reqs > self.max_num_reqs:
            raise ValueError(
                f"idx_mapping has {num_reqs} rows, more than max_num_reqs={self.max_num_reqs}.")
        self.flush_device_tables()  # this gather reads the slot-indexed device tables
        changed = True
        if idx_mapping_np is None:
            self._held_slots = None  # the host twin was not gathered: nothing is known current
            self._changed_since_gather.clear()  # (the next host gather copies every row)
        else:
            changed = self.gather_host(idx_mapping_np) is not None
        if changed:
            idx_mapping = idx_mapping.to(dtype=torch.int64)
            for table, input_table in zip(self.block_tables, self.input_block_tables):
                # index_select writes straight into the persistent rows (no realloc).
                torch.index_select(table, 0, idx_mapping, out=input_table[:num_reqs])
        return self.gathered_rows(num_reqs)

    def gather_host(self, idx_mapping_np, refresh_out: np.ndarray | None = None
                    ) -> np.ndarray | None:
        """Gather the host twin `input_block_tables_cpu` for the batch rows whose slots are
        `idx_mapping_np`, skipping what did not change, and say which rows the device copy must
        re-gather: None when no row changed, else a bool mask over the rows (written into
        `refresh_out[:num_reqs]` when given). A row changes when its slot differs from the one
        the row held at the last gather or that slot's blocks changed since (append_block_ids /
        remove_request). The caller must then re-gather exactly the flagged device rows (the
        fused step preparation does; gather_block_tables re-gathers all)."""
        slots = np.asarray(idx_mapping_np, dtype=np.int64)
        num_reqs = slots.shape[0]
        key = slots.tobytes()
        host = self._input_host_np
        refresh = None
        changed = self._changed_since_gather
        if key == self._held_slots:
            # The same rows as the last gather: refresh only rows whose slots changed since (a
            # slot of the held rows is clean after every gather, so those are its dirty rows).
            if changed:
                rows_of = self._rows_of_slot
                rows = sorted({row for slot in changed for row in rows_of.get(slot, ())})
                if rows:
                    if len(rows) <= _ROW_BY_ROW:
                        # a request or two crossed into a new block: basic-slice copies of
                        # their rows (~0.4 us each on the CPU, no fancy-index temporary)
                        tables = self.host_block_tables
                        counts, held = self._input_num_blocks, self.num_blocks
                        for row in rows:
                            host[:, row] = tables[:, slots[row]]
                            counts[:, row] = held[:, slots[row]]
                    elif num_reqs * host.shape[2] <= _FULL_REGATHER_ENTRIES:
                        host[:, :num_reqs] = self.host_block_tables[:, slots]  # small: one op
                        self._input_num_blocks[:, :num_reqs] = self.num_blocks[:, slots]
                    else:
                        host[:, rows] = self.host_block_tables[:, slots[rows]]
                        self._input_num_blocks[:, rows] = self.num_blocks[:, slots[rows]]
                    dirty_flags = self._slot_dirty
                    for slot in changed:
                        if slot in rows_of:
                            dirty_flags[slot] = False
                    refresh = rows
        else:
            host[:, :num_reqs] = self.host_block_tables[:, slots]
            self._input_num_blocks[:, :num_reqs] = self.num_blocks[:, slots]
            self._held_slots = key
            rows_of: dict[int, list[int]] = {}
            for row, slot in enumerate(slots.tolist()):
                rows_of.setdefault(slot, []).append(row)
            self._rows_of_slot = rows_of
            # Every row holding these slots is current now (rows past num_reqs are forgotten
            # with the key, so no stale copy of a slot survives unchecked).
            self._slot_dirty[slots] = False
            refresh = True
        changed.clear()
        if refresh_out is not None:
            # False / the changed rows / True written into the caller's persistent flags.
            refresh_out[:num_reqs] = refresh is True
            if isinstance(refresh, list):
                for row in refresh:
                    refresh_out[row] = True
            return None if refresh is None else refresh_out[:num_reqs]
        if refresh is None:
            return None
        mask = np.full(num_reqs, refresh is True, dtype=bool)
        if isinstance(refresh, list):
            mask[refresh] = True
        return mask

    def gathered_rows(self, num_reqs: int) -> tuple[torch.Tensor, ...]:
        """[num_reqs, max_blocks] views of the batch-order device tables, one per group (made once
        per size), after a caller refreshed them (gather_block_tables or the fused preparation)."""
        self._num_gathered_reqs = num_reqs
        views = self._row_views.get(num_reqs)
        if views is None:
            views = self._row_views[num_reqs] = tuple(t[:num_reqs]
                                                      for t in self.input_block_tables)
        return views

    def slot_mapping_view(self, num_tokens: int) -> torch.Tensor:
        """[num_groups, num_tokens] view of the persistent slot mappings (made once per size)."""
        out = self._slot_views.get(num_tokens)
        if out is None:
            out = self._slot_views[num_tokens] = self.slot_mappings[:, :num_tokens]
        return out

    def device_slot_geometry(self) -> SlotGeometry:
        """What a fused kernel needs to write slot mappings of the gathered rows itself (made
        once; the tensors are the persistent buffers, so later gathers are seen)."""
        geometry = self.__dict__.get("_device_geometry")
        if geometry is None:
            geometry = self._device_geometry = SlotGeometry(
                self.slot_mappings, self._input_block_tables, self._block_sizes,
                self._group_cp_sizes, self._group_max_blocks, self.cp_rank, self.cp_interleave)
        return geometry

    def compute_slot_mappings(self, query_start_loc: torch.Tensor,
                              positions: torch.Tensor) -> torch.Tensor:
        """Slot of every token in every group on this rank; -1 for tokens stored by another rank
        and for tail tokens past query_start_loc[num_reqs]. Uses the rows gathered last.

        Returns a [num_groups, num_tokens] view of the persistent `slot_mappings` buffer.
        """
        num_reqs = query_start_loc.shape[0] - 1
        num_tokens = positions.shape[0]
        if not 0 <= num_reqs <= self.max_num_reqs:
            raise ValueError(
                f"query_start_loc describes {num_reqs} requests; allowed 0..{self.max_num_reqs}.")
        if num_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"{num_tokens} positions exceed max_num_batched_tokens="
                f"{self.max_num_batched_tokens}.")
        for name, tensor in (("query_start_loc", query_start_loc), ("positions", positions)):
            if tensor.device.type != self.device.type:
                raise ValueError(f"{name} is on {tensor.device} but the block tables live on "
                                 f"{self.device}; pass the device buffers.")
        out = self._slot_views.get(num_tokens)
        if out is None:
            out = self._slot_views[num_tokens] = self.slot_mappings[:, :num_tokens]
        if self.device.type == "cuda" and HAS_TRITON:
            self._compute_slot_mappings_triton(query_start_loc, positions, num_reqs, num_tokens)
        else:
            self._compute_slot_mappings_torch(query_start_loc, positions, num_reqs, num_tokens)
        return out

    def _compute_slot_mappings_torch(self, query_start_loc, positions, num_reqs, num_tokens):
        query_start_loc = query_start_loc.to(device=self.device, dtype=torch.int64)
        positions = positions.to(device=self.device, dtype=torch.int64)
        token_index = torch.arange(num_tokens, device=self.device)
        # Batch row of each token; tokens past the last request get row == num_reqs (PAD).
        row = torch.searchsorted(query_start_loc[1:], token_index, right=True)
        in_batch = row < num_reqs
        row = row.clamp(max=max(num_reqs - 1, 0))
        for group, block_size in enumerate(self.block_sizes):
            group_cp, max_blocks = self.group_cp_sizes[group], self.group_max_blocks[group]
            block_index, owned, local_offset = _slot_geometry(
                positions, block_size, group_cp, self.group_cp_ranks[group], self.cp_interleave)
            bad = in_batch & ((block_index >= max_blocks) | (positions < 0))
            if bool(bad.any()):
                raise ValueError(
                    f"position {int(positions[bad][0])} falls outside the block table of group "
                    f"{group} ({max_blocks} blocks of {block_size * group_cp} tokens).")
            table = self.input_block_tables[group]
            block_id = table[row, block_index.clamp(0, max_blocks - 1)]
            slots = block_id.to(torch.int64) * block_size + local_offset
            slots = torch.where(owned & in_batch, slots, torch.full_like(slots, PAD_SLOT_ID))
            self.slot_mappings[group, :num_tokens].copy_(slots)

    def _compute_slot_mappings_triton(self, query_start_loc, positions, num_reqs, num_tokens):
        grid = (self.num_kv_cache_groups, num_reqs + 1)
        _compute_slot_mappings_kernel[grid](
            self.slot_mappings, self.slot_mappings.stride(0),
            self._input_block_tables, self._input_block_tables.stride(0),
            self._input_block_tables.stride(1), self._block_sizes, self._group_cp_sizes,
            self._group_max_blocks, query_start_loc, positions, num_reqs, num_tokens,
            self.cp_rank, self.cp_interleave, BLOCK=256)
