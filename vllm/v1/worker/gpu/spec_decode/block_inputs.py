"""The uniform draft rows' per-step inputs in one fused write (DFlash/DSpark blocks, and the
EAGLE/MTP autoregressive steps as blocks of one token).

A uniform draft step: request i drafts Q tokens at positions start[i] + arange(Q), with
start[i] = accepted[i] + start_offset (block drafters: offset 0, the anchor's position; EAGLE step
s: offset s - 1), positions clamped to max_model_len - 1; its draft seq_len is
min(start[i] + Q, max_model_len) and the row's first id is `next_token_ids[i]` (the anchor, or the
previous draft). Two optional indirections let a caller hand over device state as it lies instead
of preparing it with torch ops first (the early draft step: one launch instead of five,
GPUModelRunner._prepare_draft_early): `accepted_extra` adds a per-row term to accepted (start[i]
= accepted[i] + accepted_extra[i] + start_offset: the verify step's target lengths plus the
tokens it emitted, less Q) and `next_token_rows` reads the first ids through a row -> slot map
(next_token_ids[next_token_rows[i]]: the requests' last sampled tokens by slot). One call
writes, for `padded` rows (rows past num_reqs are CUDA-graph padding: id 0, positions 0,
length 0, PAD slots):
  - anchors[row] and input_ids[row * Q] (the mask columns 1.. are the caller's, written once);
  - positions[row * Q + j];
  - seq_lens[row];
  - slot_mappings[g, row * Q + j] for each of the drafter's own KV cache groups g (the same slot
    formula as BlockTables.compute_slot_mappings; other groups' rows are left as they are: the
    draft forward builds only its own groups).
Rank-local DCP lengths are NOT written here: the shared base builder recomputes them from the
draft's seq_lens for every speculator (DESIGN §6), through the patchable
`speculator.prepare_dcp_local_seq_lens`.

On CUDA this is one Triton launch (no host sync, capturable); elsewhere a torch twin with identical
results. Before, the same writes took 6-9 torch ops plus the slot-mapping launch per forward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.v1.attention.backends.mla.plan_lowering import PlanLowering
from vllm.v1.worker.gpu.block_table import PAD_SLOT_ID, BlockTables
from vllm.utils.triton_launch import LeanLaunch, base_and_offset
from vllm.v1.worker.gpu.cp_utils import HAS_TRITON, _slot_geometry, tl, triton
if HAS_TRITON:
    from vllm.v1.worker.gpu.cp_utils import slot_geometry_tl


@dataclass
class BlockInputBuffers:
    """The persistent buffers one fused write fills (all on the drafter's device)."""

    input_ids: torch.Tensor   # [max_num_tokens] int64; [row * Q] gets the anchor
    positions: torch.Tensor   # [max_num_tokens] int64
    seq_lens: torch.Tensor    # [max_num_reqs] int32
    anchors: torch.Tensor     # [max_num_reqs] int64
    group_ids: torch.Tensor   # [G] int32 device copy of the drafter's KV cache groups
    group_ids_host: tuple[int, ...]  # the same ids (the torch twin loops over them)
    offsets: torch.Tensor     # [Q] int64 arange(Q) (the torch twin's column offsets)


if HAS_TRITON:

    @triton.jit
    def _store_request_length(ws_ptr, index_ptr, count, mine, value, BLOCK: tl.constexpr):
        """ws[index[i]] = value for the entries i < count whose request index[count + i] is
        `mine` (plan_lowering.py's index layout: `count` positions, then their requests)."""
        for i0 in range(0, count, BLOCK):
            i = i0 + tl.arange(0, BLOCK)
            on = i < count
            req = tl.load(index_ptr + count + i, mask=on, other=-1)
            hit = on & (req == mine)
            at = tl.load(index_ptr + i, mask=hit, other=0)
            tl.store(ws_ptr + at, value, mask=hit)

    # Per-step row counts are not specialised on (one compiled variant per Q, no JIT
    # mid-serving).
    @triton.jit(do_not_specialize=["num_reqs", "start_offset", "next_offset", "extra_offset",
                                   "lower_num_len", "lower_num_end"])
    def _block_draft_inputs_kernel(
        input_ids_ptr,        # [max_num_tokens] int64
        positions_ptr,        # [max_num_tokens] int64
        seq_lens_ptr,         # [max_num_reqs] int32
        anchors_ptr,          # [max_num_reqs] int64
        accepted_ptr,         # [num_reqs] int64: accepted prefix length = anchor position
        next_tokens_ptr,      # base of the first ids: row i at next_offset + i * next_stride
        next_offset,
        next_stride,
        next_rows_ptr,        # HAS_NEXT_ROWS: [num_reqs] int64, the first id of row i is at
                              # next_offset + next_rows[i] * next_stride
        extra_ptr,            # HAS_EXTRA: row i adds extra[extra_offset + i * extra_stride]
        extra_offset,
        extra_stride,
        group_ids_ptr,        # [G] int32: the drafter's KV cache groups
        slot_mappings_ptr,    # [num_groups, slot_stride] int64
        slot_stride,
        tables_ptr,           # [num_groups, max_num_reqs, max_blocks] int32 (gathered rows)
        table_group_stride,
        table_row_stride,
        block_sizes_ptr,      # [num_groups] int32
        group_cp_sizes_ptr,   # [num_groups] int32: cp_size (sharded) or 1 (replicated)
        group_max_blocks_ptr,  # [num_groups] int32
        num_reqs,
        max_model_len,
        start_offset,         # the block starts at accepted + start_offset
        cp_rank,
        cp_interleave,
        lower_ws_ptr,         # LOWER: a held draft plan's int32 workspace (plan_lowering.py)
        lower_index_ptr,      # LOWER: [2 * num_len + 2 * num_end] int64 positions / requests
        lower_kv_len_ptr,     # LOWER: the plan's kv_len_arr
        lower_num_len,
        lower_num_end,
        Q: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        HAS_NEXT_ROWS: tl.constexpr,
        HAS_EXTRA: tl.constexpr,
        LOWER: tl.constexpr,
        LOWER_BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        group_slot = tl.program_id(1)
        real = row < num_reqs
        cols = tl.arange(0, BLOCK_Q)
        in_block = cols < Q
        token = row.to(tl.int64) * Q + cols
        start = tl.load(accepted_ptr + row, mask=real, other=0).to(tl.int64) + start_offset
        if HAS_EXTRA:
            start += tl.load(extra_ptr + extra_offset + row.to(tl.int64) * extra_stride,
                             mask=real, other=0).to(tl.int64)
        # Clamped positions only occur for drafts the scheduler drops at max_model_len.
        pos = tl.where(real, tl.minimum(start + cols, max_model_len - 1), 0)
        if group_slot == 0:  # one program per row writes the row's non-slot inputs
            source = row.to(tl.int64)
            if HAS_NEXT_ROWS:
                source = tl.load(next_rows_ptr + row, mask=real, other=0).to(tl.int64)
            anchor = tl.load(next_tokens_ptr + next_offset + source * next_stride, mask=real,
                             other=0).to(tl.int64)
            tl.store(anchors_ptr + row, anchor)
            tl.store(input_ids_ptr + row.to(tl.int64) * Q, anchor)
            tl.store(positions_ptr + token, pos, mask=in_block)
            seq_len = tl.where(real, tl.minimum(start + Q, max_model_len), 0)
            tl.store(seq_lens_ptr + row, seq_len.to(seq_lens_ptr.dtype.element_ty))
            if LOWER:
                # The plan lowering of this row's request (lower_plan_triton's writes, with
                # the length just computed): the kv_len of its works, the kv_end of its last
                # work, and its kv_len_arr entry (the index lists real requests only).
                mine = tl.where(real, row.to(tl.int64), -1)
                value = tl.full([LOWER_BLOCK], 0, tl.int32) + seq_len.to(tl.int32)
                # the kv_len of every work (index entries 0 .. 2n), then every kv_end (2n ..)
                _store_request_length(lower_ws_ptr, lower_index_ptr, lower_num_len, mine, value,
                                      LOWER_BLOCK)
                _store_request_length(lower_ws_ptr, lower_index_ptr + 2 * lower_num_len,
                                      lower_num_end, mine, value, LOWER_BLOCK)
                tl.store(lower_kv_len_ptr + row,
                         seq_len.to(lower_kv_len_ptr.dtype.element_ty), mask=real)
        group = tl.load(group_ids_ptr + group_slot).to(tl.int64)
        block_size = tl.load(block_sizes_ptr + group).to(tl.int64)
        # A replicated group is a one-rank group: it owns every token (rank 0 of 1).
        group_cp = tl.load(group_cp_sizes_ptr + group).to(tl.int64)
        group_rank = tl.where(group_cp == 1, 0, cp_rank)
        max_blocks = tl.load(group_max_blocks_ptr + group).to(tl.int64)
        block_index, owned, local_offset = slot_geometry_tl(pos, block_size, group_cp,
                                                            group_rank, cp_interleave)
        # Out-of-table positions become PAD (as in the slot-mapping kernel) rather than
        # overwriting block 0, which may belong to another request.
        readable = in_block & real & (block_index < max_blocks)
        table_row = tables_ptr + group * table_group_stride + row.to(tl.int64) * table_row_stride
        block_id = tl.load(table_row + block_index, mask=readable, other=0).to(tl.int64)
        slot = tl.where(owned & readable, block_id * block_size + local_offset, -1)
        tl.store(slot_mappings_ptr + group * slot_stride + token, slot, mask=in_block)


def _check_args(tables: BlockTables, buffers: BlockInputBuffers, num_reqs: int, padded: int,
                q: int, accepted: torch.Tensor, next_token_ids: torch.Tensor,
                accepted_extra: torch.Tensor | None, next_token_rows: torch.Tensor | None
                ) -> None:
    if not 0 <= num_reqs <= padded <= buffers.seq_lens.shape[0]:
        raise ValueError(f"need 0 <= num_reqs ({num_reqs}) <= padded ({padded}) <= "
                         f"max_num_reqs ({buffers.seq_lens.shape[0]}).")
    if q < 1:
        raise ValueError(f"the block length Q={q} must be >= 1.")
    num_tokens = padded * q
    if num_tokens > min(buffers.positions.shape[0], tables.max_num_batched_tokens):
        raise ValueError(f"{padded} rows of Q={q} tokens do not fit the token buffers.")
    first = next_token_ids if next_token_rows is None else next_token_rows
    if (accepted.shape[0] < num_reqs or first.shape[0] < num_reqs
            or (accepted_extra is not None and accepted_extra.shape[0] < num_reqs)):
        # (every draft step checks: the names are gathered only for the message)
        rows = {"accepted": accepted,
                "next_token_ids" if next_token_rows is None else "next_token_rows": first}
        if accepted_extra is not None:
            rows["accepted_extra"] = accepted_extra
        short = {name: t.shape[0] for name, t in rows.items() if t.shape[0] < num_reqs}
        raise ValueError(f"{short} (rows) need num_reqs={num_reqs} rows.")


def write_block_inputs_torch(tables: BlockTables, buffers: BlockInputBuffers, num_reqs: int,
                             padded: int, q: int, accepted: torch.Tensor,
                             next_token_ids: torch.Tensor, max_model_len: int,
                             start_offset: int = 0, accepted_extra: torch.Tensor | None = None,
                             next_token_rows: torch.Tensor | None = None,
                             lowering: PlanLowering | None = None) -> None:
    """The torch twin of the fused kernel (CPU, or CUDA without Triton)."""
    num_tokens = padded * q
    anchors = buffers.anchors[:padded]
    positions = buffers.positions[:num_tokens].view(padded, q)
    seq_lens = buffers.seq_lens[:padded]
    if padded > num_reqs:  # CUDA-graph padding rows: anchor 0, positions 0, length 0
        for tensor in (anchors, positions, seq_lens):
            tensor[num_reqs:].zero_()
    if next_token_rows is not None:
        next_token_ids = next_token_ids[next_token_rows[:num_reqs]]
    anchors[:num_reqs].copy_(next_token_ids[:num_reqs])
    buffers.input_ids[:num_tokens].view(padded, q)[:, 0] = anchors
    accepted = accepted[:num_reqs].to(torch.int64)
    if accepted_extra is not None:
        accepted = accepted + accepted_extra[:num_reqs]
    if start_offset:
        accepted = accepted + start_offset
    torch.add(accepted[:, None], buffers.offsets, out=positions[:num_reqs])
    positions[:num_reqs].clamp_(max=max_model_len - 1)
    torch.add(accepted, q, out=seq_lens[:num_reqs])
    seq_lens[:num_reqs].clamp_(max=max_model_len)
    _slots_torch(tables, buffers.group_ids_host, positions.reshape(-1), num_reqs * q, num_tokens,
                 q)
    if lowering is not None:
        lowering.apply_torch(buffers.seq_lens)


def _slots_torch(tables: BlockTables, group_ids: tuple[int, ...], positions: torch.Tensor,
                 num_real_tokens: int, num_tokens: int, q: int) -> None:
    """Slots of the block tokens in each drafter group; tokens of padding rows are PAD."""
    row = torch.div(torch.arange(num_tokens, device=positions.device), q, rounding_mode="floor")
    real = row < num_real_tokens // q
    for group in group_ids:
        block_size, max_blocks = tables.block_sizes[group], tables.group_max_blocks[group]
        block_index, owned, local_offset = _slot_geometry(
            positions, block_size, tables.group_cp_sizes[group], tables.group_cp_ranks[group],
            tables.cp_interleave)
        # A table overrun is a caller bug; the host path says so (the kernel PADs instead).
        if num_real_tokens and int(block_index[:num_real_tokens].max()) >= max_blocks:
            raise ValueError(f"a block position falls outside the block table of group {group} "
                             f"({max_blocks} blocks of {block_size * tables.group_cp_sizes[group]}"
                             " tokens).")
        table = tables.input_block_tables[group]
        block_id = table[row.clamp(max=table.shape[0] - 1), block_index.clamp(max=max_blocks - 1)]
        slots = block_id.to(torch.int64) * block_size + local_offset
        tables.slot_mappings[group, :num_tokens] = torch.where(owned & real, slots, PAD_SLOT_ID)


# Through LeanLaunch (vllm/utils/triton_launch.py), lean by default (VLLM_LEAN_TRITON_LAUNCH=0
# turns it off). Why this kernel and not the step preparation: its 26 runtime arguments cost ~0.06 ms
# of a DSpark step's ~0.76 ms host time through Triton's binding (twenty-sixth session's B=1
# profile, H100), only block drafters launch it, and the one unexplained loss with lean
# launches was the no-drafts engine's (its step-preparation kernel) at B=8; DSpark engines with
# every kernel lean matched or beat those without (runs HB, HG, JC, docs/performance.md).
_LOWER_BLOCK = 64  # index entries a program scans at a time for its row's works
_BLOCK_INPUTS_LAUNCH = (LeanLaunch(_block_draft_inputs_kernel, default=True) if HAS_TRITON
                        else None)


def write_block_inputs_triton(tables: BlockTables, buffers: BlockInputBuffers, num_reqs: int,
                              padded: int, q: int, accepted: torch.Tensor,
                              next_token_ids: torch.Tensor, max_model_len: int,
                              start_offset: int = 0, accepted_extra: torch.Tensor | None = None,
                              next_token_rows: torch.Tensor | None = None,
                              lowering: PlanLowering | None = None) -> None:
    geometry = tables.device_slot_geometry()
    base, next_offset = base_and_offset(next_token_ids)
    # Unused indirections get a valid pointer that the kernel never reads (constexpr off).
    extra, extra_offset, extra_stride = buffers.anchors, 0, 0
    if accepted_extra is not None:
        extra, extra_offset = base_and_offset(accepted_extra)
        extra_stride = accepted_extra.stride(0)
    rows = buffers.anchors if next_token_rows is None else next_token_rows
    # Without a lowering its pointers are the row buffers' (never read: LOWER is off).
    if lowering is None:
        low_ws, low_index, low_arr, low_n, low_m = (buffers.seq_lens, buffers.anchors,
                                                    buffers.seq_lens, 0, 0)
    else:
        low_ws, low_index, low_arr = lowering.ws, lowering.index, lowering.kv_len_arr
        low_n, low_m = lowering.num_len, lowering.num_end
    grid = (padded, len(buffers.group_ids_host))
    _BLOCK_INPUTS_LAUNCH(
        grid, buffers.input_ids, buffers.positions, buffers.seq_lens, buffers.anchors, accepted,
        base, next_offset, next_token_ids.stride(0), rows, extra, extra_offset, extra_stride,
        buffers.group_ids, geometry.slot_mappings,
        geometry.slot_mappings.stride(0), geometry.input_block_tables,
        geometry.input_block_tables.stride(0), geometry.input_block_tables.stride(1),
        geometry.block_sizes, geometry.group_cp_sizes, geometry.group_max_blocks, num_reqs,
        max_model_len, start_offset, geometry.cp_rank, geometry.cp_interleave, low_ws,
        low_index, low_arr, low_n, low_m, Q=q, BLOCK_Q=triton.next_power_of_2(q),
        HAS_NEXT_ROWS=next_token_rows is not None, HAS_EXTRA=accepted_extra is not None,
        LOWER=lowering is not None, LOWER_BLOCK=_LOWER_BLOCK)


def write_block_inputs(tables: BlockTables, buffers: BlockInputBuffers, num_reqs: int,
                       padded: int, q: int, accepted: torch.Tensor, next_token_ids: torch.Tensor,
                       max_model_len: int, start_offset: int = 0,
                       accepted_extra: torch.Tensor | None = None,
                       next_token_rows: torch.Tensor | None = None,
                       lowering: PlanLowering | None = None) -> torch.Tensor:
    """Write the block inputs of `padded` rows (see the module docstring). Returns the
    [num_groups, padded * Q] view of the persistent slot mappings; only the drafter's groups'
    rows were written (the draft forward reads no other group). `lowering`: a held draft
    plan whose lengths are these rows' new seq_lens (its requests are the first num_reqs
    rows): its work arrays get them in the same launch (plan_lowering.PlanLowering)."""
    _check_args(tables, buffers, num_reqs, padded, q, accepted, next_token_ids, accepted_extra,
                next_token_rows)
    if lowering is not None and lowering.num_reqs != num_reqs:
        raise ValueError(f"the plan lowering is for {lowering.num_reqs} requests; this write "
                         f"has num_reqs={num_reqs}")
    write = (write_block_inputs_triton if buffers.positions.is_cuda and HAS_TRITON
             else write_block_inputs_torch)
    write(tables, buffers, num_reqs, padded, q, accepted, next_token_ids, max_model_len,
          start_offset, accepted_extra, next_token_rows, lowering)
    return tables.slot_mapping_view(padded * q)
