"""The whole device-side preparation of a step in ONE launch (Triton on CUDA, a torch twin elsewhere).

From the step's staged per-row arrays (query_start_loc, request slot, context length, prefill flag,
cumulative logits, block-table refresh flag: one packed host->device copy) and the slot-indexed
state (last sampled token, drafts, block tables), one program per batch row writes:

  * positions and input ids of its tokens (anchor + drafts gathered by slot, or staged prefill ids);
  * its global seq_len and, under DCP, its rank-local length;
  * its logits indices;
  * its rows of the batch-order block tables, only when the host says they changed (`refresh`);
  * its tokens' slot mappings in every KV cache group (read from the slot-indexed tables, which
    equal the rows being gathered, so no program waits for another).

One extra program writes the CUDA-graph padding: tail tokens (position 0, id 0, PAD slot) and rows
past the padded batch (length 0). Before this kernel the same work took four to five launches
(input prep, DCP lengths, one gather per group, slot mappings) and the host paid each one.

`prepare_step_torch` is the kernel's twin with identical semantics (every buffer written the same,
including padding and out-of-table positions, which become PAD slots); tests compare the two under
Triton's interpreter and on the GPU, and the twin against a brute-force host computation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.triton_utils import HAS_TRITON, tl, triton
from vllm.utils.triton_launch import LeanLaunch
from vllm.v1.worker.gpu.cp_utils import _slot_geometry

if HAS_TRITON:
    from vllm.v1.worker.gpu.cp_utils import slot_geometry_tl

PAD_SLOT_ID = -1


@dataclass
class StepPrepBuffers:
    """Every tensor the fused preparation reads or writes (persistent buffers; no views made per
    step). Row-indexed inputs come from the packed staging copy; slot-indexed from RequestStates
    and BlockTables."""

    # outputs
    input_ids: torch.Tensor        # [max_tokens] int64
    positions: torch.Tensor        # [max_tokens] int64
    seq_lens: torch.Tensor         # [max_rows] int32
    logits_indices: torch.Tensor   # [max_tokens] int64
    dcp_local_seq_lens: torch.Tensor  # [max_rows] int32 (written only under DCP)
    slot_mappings: torch.Tensor    # [num_groups, max_tokens] int64
    input_tables: torch.Tensor     # [num_groups, max_rows, cols] int32 batch-order rows
    # row-indexed staged inputs
    query_start_loc: torch.Tensor  # [max_rows + 1] int32
    idx_mapping: torch.Tensor      # [max_rows] int64 slot of each row
    is_prefill: torch.Tensor       # [max_rows] bool
    prefill_ids: torch.Tensor      # [max_tokens] int64 staged ids of prefill rows
    cu_num_logits: torch.Tensor    # [max_rows + 1] int32
    num_computed: torch.Tensor     # [max_rows] int32 context tokens of each row
    refresh: torch.Tensor          # [max_rows] bool: re-gather this row's block tables
    # deferred block-table writes (BlockTables.take_patches): sorted cell keys
    # slot * (groups * cols) + group * cols + col, their values, and each row's key range
    patch_keys: torch.Tensor       # [max_patches] int64
    patch_values: torch.Tensor     # [max_patches] int32
    patch_lo: torch.Tensor         # [max_rows] int32
    patch_hi: torch.Tensor         # [max_rows] int32
    # slot-indexed state
    last_sampled: torch.Tensor     # [slots + 1] int64
    draft_tokens: torch.Tensor     # [slots, k] int64
    tables: torch.Tensor           # [num_groups, slots, cols] int32
    # per-group geometry
    block_sizes: torch.Tensor      # [num_groups] int32
    group_cp_sizes: torch.Tensor   # [num_groups] int32 (1 = replicated group)
    group_max_blocks: torch.Tensor  # [num_groups] int32 table entries a row may use
    block_sizes_host: tuple[int, ...]
    group_cp_sizes_host: tuple[int, ...]
    group_max_blocks_host: tuple[int, ...]


if HAS_TRITON:

    # The per-step counts are not specialised on: Triton would otherwise compile a variant for
    # each new (== 1, divisible by 16, other) combination of them, a JIT build (~0.1-1 s) in the
    # middle of serving whenever a batch first reaches one.
    @triton.jit(do_not_specialize=["num_patches", "num_reqs", "num_rows", "num_tokens_padded"])
    def _prepare_step_kernel(
        input_ids_ptr, positions_ptr, seq_lens_ptr, logits_idx_ptr, dcp_local_ptr,
        slot_ptr, slot_stride, in_tab_ptr, in_tab_gstride, in_tab_rstride,
        qsl_ptr, idx_ptr, is_prefill_ptr, prefill_ids_ptr, cu_logits_ptr, num_computed_ptr,
        refresh_ptr, last_sampled_ptr, drafts_ptr, drafts_stride, num_draft_cols,
        tab_ptr, tab_gstride, tab_rstride, table_cols,
        patch_keys_ptr, patch_values_ptr, patch_lo_ptr, patch_hi_ptr, num_patches,
        block_sizes_ptr, group_cp_ptr, group_max_blocks_ptr, num_groups,
        num_reqs, num_rows, num_tokens_padded, max_rows, cp_size, cp_rank, cp_interleave,
        HAS_DCP: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        if row < num_rows:
            start = tl.load(qsl_ptr + row).to(tl.int64)
            end = tl.load(qsl_ptr + row + 1).to(tl.int64)
            slot = tl.load(idx_ptr + row).to(tl.int64)
            computed = tl.load(num_computed_ptr + row).to(tl.int64)
            prefill = tl.load(is_prefill_ptr + row).to(tl.int1)
            anchor = tl.load(last_sampled_ptr + slot)
            seq_len = tl.where(row < num_reqs, computed + end - start, 0)
            tl.store(seq_lens_ptr + row, seq_len.to(seq_lens_ptr.dtype.element_ty))
            if HAS_DCP:
                span = cp_size * cp_interleave
                rounds = seq_len // span
                part = seq_len - rounds * span - cp_rank * cp_interleave
                part = tl.minimum(tl.maximum(part, 0), cp_interleave)
                tl.store(dcp_local_ptr + row,
                         (rounds * cp_interleave + part).to(dcp_local_ptr.dtype.element_ty))
            # This slot's deferred table writes: keys [p_lo, p_hi) are relative to the slot's
            # first cell; every read of the slot's table below applies them in registers (the
            # padding program writes them back; a concurrent read sees the old or the new value
            # and patches it either way, so no program waits for another).
            p_lo = tl.load(patch_lo_ptr + row)
            p_hi = tl.load(patch_hi_ptr + row)
            slot_first_cell = slot * num_groups * table_cols
            # Block-table rows of this batch row (only when the host saw them change).
            if tl.load(refresh_ptr + row).to(tl.int1):
                for g in range(num_groups):
                    src = tab_ptr + g * tab_gstride + slot * tab_rstride
                    dst = in_tab_ptr + g * in_tab_gstride + row * in_tab_rstride
                    for c0 in range(0, table_cols, BLOCK):
                        cols = c0 + tl.arange(0, BLOCK)
                        keep = cols < table_cols
                        vals = tl.load(src + cols, mask=keep, other=0)
                        for p in range(p_lo, p_hi):
                            cell = tl.load(patch_keys_ptr + p).to(tl.int64) - slot_first_cell
                            vals = tl.where(cols + g * table_cols == cell,
                                            tl.load(patch_values_ptr + p), vals)
                        tl.store(dst + cols, vals, mask=keep)
            for first in range(start, end, BLOCK):
                offs = first + tl.arange(0, BLOCK)
                live = offs < end
                j = offs - start
                pos = computed + j
                tl.store(positions_ptr + offs, pos, mask=live)
                # Drafts only for decode rows and inside the [slots, k] buffer.
                col = tl.minimum(tl.maximum(j - 1, 0), num_draft_cols - 1)
                draft = tl.load(drafts_ptr + slot * drafts_stride + col,
                                mask=live & (j > 0) & (j <= num_draft_cols) & (prefill == 0),
                                other=0)
                decode_id = tl.where(j == 0, anchor, draft)
                staged = tl.load(prefill_ids_ptr + offs, mask=live & prefill, other=0)
                tl.store(input_ids_ptr + offs, tl.where(prefill, staged, decode_id), mask=live)
                # Slot mappings of every group (DESIGN §2), from the slot-indexed tables.
                for g in range(num_groups):
                    block_size = tl.load(block_sizes_ptr + g).to(tl.int64)
                    group_cp = tl.load(group_cp_ptr + g).to(tl.int64)
                    group_rank = tl.where(group_cp == 1, 0, cp_rank)
                    max_blocks = tl.load(group_max_blocks_ptr + g).to(tl.int64)
                    block_index, owned, local = slot_geometry_tl(
                        pos, block_size, group_cp, group_rank, cp_interleave)
                    readable = live & (block_index < max_blocks)
                    block_id = tl.load(tab_ptr + g * tab_gstride + slot * tab_rstride
                                       + block_index, mask=readable, other=0)
                    for p in range(p_lo, p_hi):
                        cell = tl.load(patch_keys_ptr + p).to(tl.int64) - slot_first_cell
                        block_id = tl.where(block_index + g * table_cols == cell,
                                            tl.load(patch_values_ptr + p), block_id)
                    block_id = block_id.to(tl.int64)
                    slot_id = tl.where(owned & readable, block_id * block_size + local, -1)
                    tl.store(slot_ptr + g * slot_stride + offs, slot_id, mask=live)
            if row < num_reqs:
                l0 = tl.load(cu_logits_ptr + row).to(tl.int64)
                l1 = tl.load(cu_logits_ptr + row + 1).to(tl.int64)
                for logit_first in range(l0, l1, BLOCK):
                    logit_offs = logit_first + tl.arange(0, BLOCK)
                    tl.store(logits_idx_ptr + logit_offs, end - (l1 - logit_offs),
                             mask=logit_offs < l1)
        else:
            # The deferred table writes go to the slot-indexed tables (for later steps).
            for pf in range(0, num_patches, BLOCK):
                p_offs = pf + tl.arange(0, BLOCK)
                p_live = p_offs < num_patches
                key = tl.load(patch_keys_ptr + p_offs, mask=p_live, other=0).to(tl.int64)
                p_slot = key // (num_groups * table_cols)
                p_rest = key - p_slot * (num_groups * table_cols)
                p_group = p_rest // table_cols
                p_col = p_rest - p_group * table_cols
                tl.store(tab_ptr + p_group * tab_gstride + p_slot * tab_rstride + p_col,
                         tl.load(patch_values_ptr + p_offs, mask=p_live, other=0), mask=p_live)
            # CUDA-graph padding: tail tokens read token 0 at position 0 and store nothing;
            # rows past the padded batch have length 0.
            tail = tl.load(qsl_ptr + num_rows).to(tl.int64)
            for tail_first in range(tail, num_tokens_padded, BLOCK):
                offs = tail_first + tl.arange(0, BLOCK)
                live = offs < num_tokens_padded
                tl.store(positions_ptr + offs, tl.zeros((BLOCK,), tl.int64), mask=live)
                tl.store(input_ids_ptr + offs, tl.zeros((BLOCK,), tl.int64), mask=live)
                for g in range(num_groups):
                    tl.store(slot_ptr + g * slot_stride + offs,
                             tl.full((BLOCK,), -1, tl.int64), mask=live)
            for row_first in range(num_rows, max_rows, BLOCK):
                rows = row_first + tl.arange(0, BLOCK)
                zero = tl.zeros((BLOCK,), tl.int32)
                tl.store(seq_lens_ptr + rows, zero.to(seq_lens_ptr.dtype.element_ty),
                         mask=rows < max_rows)
                if HAS_DCP:
                    tl.store(dcp_local_ptr + rows, zero.to(dcp_local_ptr.dtype.element_ty),
                             mask=rows < max_rows)


# The kernel takes ~45 arguments, all persistent buffers, their strides and per-step counts it
# does not specialise on: launched through LeanLaunch (vllm/utils/triton_launch.py), which
# skips Triton's per-call binding when VLLM_LEAN_TRITON_LAUNCH=1 (off by default).
_PREPARE_LAUNCH = LeanLaunch(_prepare_step_kernel) if HAS_TRITON else None


def prepare_step_triton(b: StepPrepBuffers, num_reqs: int, num_rows: int, num_tokens_padded: int,
                        cp_size: int, cp_rank: int, cp_interleave: int,
                        num_patches: int = 0) -> None:
    """One launch: grid = one program per padded row + one for the padding."""
    _PREPARE_LAUNCH(
        (num_rows + 1,),
        b.input_ids, b.positions, b.seq_lens, b.logits_indices, b.dcp_local_seq_lens,
        b.slot_mappings, b.slot_mappings.stride(0), b.input_tables, b.input_tables.stride(0),
        b.input_tables.stride(1), b.query_start_loc, b.idx_mapping, b.is_prefill, b.prefill_ids,
        b.cu_num_logits, b.num_computed, b.refresh, b.last_sampled, b.draft_tokens,
        b.draft_tokens.stride(0), b.draft_tokens.shape[1], b.tables, b.tables.stride(0),
        b.tables.stride(1), b.tables.shape[2], b.patch_keys, b.patch_values, b.patch_lo,
        b.patch_hi, num_patches, b.block_sizes, b.group_cp_sizes,
        b.group_max_blocks, b.tables.shape[0], num_reqs, num_rows, num_tokens_padded,
        b.seq_lens.shape[0], cp_size, cp_rank, cp_interleave,
        HAS_DCP=cp_size > 1, BLOCK=128)


def prepare_step_torch(b: StepPrepBuffers, num_reqs: int, num_rows: int, num_tokens_padded: int,
                       cp_size: int, cp_rank: int, cp_interleave: int,
                       num_logits: int, num_patches: int = 0) -> None:
    """The kernel's twin in torch ops (CPU path; the reference for the kernel's tests). Writes
    exactly what the kernel writes. `num_logits` = cu_num_logits[num_reqs] (the kernel reads it
    on the device; the twin needs the size, which the host knows)."""
    B, R, T = num_reqs, num_rows, num_tokens_padded
    dev = b.input_ids.device
    i64 = torch.int64
    if num_patches:
        # The deferred table writes first: every later read then sees them (the kernel patches
        # its reads in registers instead; patch_lo / patch_hi only serve that).
        G, _, C = b.tables.shape
        key = b.patch_keys[:num_patches].to(i64)
        p_slot = torch.div(key, G * C, rounding_mode="floor")
        p_rest = key - p_slot * (G * C)
        p_group = torch.div(p_rest, C, rounding_mode="floor")
        b.tables.index_put_((p_group, p_slot, p_rest - p_group * C),
                            b.patch_values[:num_patches].to(b.tables.dtype))
    qsl = b.query_start_loc[: R + 1].to(i64)
    tok = torch.arange(T, dtype=i64, device=dev)
    row = torch.searchsorted(qsl[1:], tok, right=True)
    in_batch = tok < qsl[R]
    row = row.clamp(max=max(R - 1, 0))
    offset = tok - qsl[row]
    slot = b.idx_mapping[:R].to(i64)[row] if R else torch.zeros_like(tok)
    computed = b.num_computed[:R].to(i64)[row] if R else torch.zeros_like(tok)
    pos = computed + offset
    zeros = torch.zeros_like(tok)
    b.positions[:T].copy_(torch.where(in_batch, pos, zeros))
    k = b.draft_tokens.shape[1]
    draft_col = (offset - 1).clamp(0, k - 1)
    decode_ids = torch.where(offset == 0, b.last_sampled[slot], b.draft_tokens[slot, draft_col])
    prefill = b.is_prefill[:R][row] if R else torch.zeros_like(tok, dtype=torch.bool)
    ids = torch.where(prefill, b.prefill_ids[:T], decode_ids)
    b.input_ids[:T].copy_(torch.where(in_batch, ids, zeros))

    rows = torch.arange(R, dtype=i64, device=dev)
    qlen = qsl[1:] - qsl[:-1]
    seq = torch.where(rows < B, b.num_computed[:R].to(i64) + qlen, torch.zeros_like(rows))
    b.seq_lens[:R].copy_(seq)
    b.seq_lens[R:].zero_()
    if cp_size > 1:
        span = cp_size * cp_interleave
        rounds = torch.div(seq, span, rounding_mode="floor")
        part = (seq - rounds * span - cp_rank * cp_interleave).clamp(0, cp_interleave)
        b.dcp_local_seq_lens[:R].copy_(rounds * cp_interleave + part)
        b.dcp_local_seq_lens[R:].zero_()

    if num_logits:
        cu = b.cu_num_logits[: B + 1].to(i64)
        lidx = torch.arange(num_logits, dtype=i64, device=dev)
        lrow = torch.searchsorted(cu[1:], lidx, right=True)
        b.logits_indices[:num_logits].copy_(qsl[lrow + 1] - (cu[lrow + 1] - lidx))

    # Block-table rows flagged by the host: gathered from the slot-indexed tables.
    if R:
        refresh = b.refresh[:R]
        gathered = b.tables.index_select(1, b.idx_mapping[:R].to(i64))
        current = b.input_tables[:, :R]
        current.copy_(torch.where(refresh[None, :, None], gathered, current))

    # Slot mappings: real tokens from their slot's table, padding tail tokens PAD.
    for g, (block_size, group_cp, max_blocks) in enumerate(zip(
            b.block_sizes_host, b.group_cp_sizes_host, b.group_max_blocks_host)):
        group_rank = 0 if group_cp == 1 else cp_rank
        block_index, owned, local = _slot_geometry(pos, block_size, group_cp, group_rank,
                                                   cp_interleave)
        readable = in_batch & (block_index < max_blocks)
        block_id = b.tables[g][slot, block_index.clamp(0, max_blocks - 1)].to(i64)
        b.slot_mappings[g, :T].copy_(torch.where(owned & readable, block_id * block_size + local,
                                                 torch.full_like(tok, PAD_SLOT_ID)))
