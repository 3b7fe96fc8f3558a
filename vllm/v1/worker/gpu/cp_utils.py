"""Decode Context Parallelism (DCP) geometry: which rank stores which token, and where.

N = DCP world size (cp_size), r = rank, I = interleave size (DESIGN §2):
  - global position t lives on rank (t // I) % N at local index (t // (I*N)) * I + t % I;
  - a sequence of global length L has local(L, r) = (L // (N*I)) * I + clamp(L % (N*I) - r*I, 0, I)
    tokens on rank r, and the local lengths of all ranks sum to L.

On CUDA the buffer-filling op runs as a Triton kernel (capturable in a CUDA graph, no host sync);
everywhere else it runs as plain torch with identical results. Triton is imported behind a guard so
CPU-only machines without a working Triton still import this module.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm.triton_utils import HAS_TRITON, tl, triton  # noqa: F401


def _check_geometry(cp_size: int, cp_rank: int | None, cp_interleave: int) -> None:
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size={cp_size!r} is invalid: the DCP world size must be an int >= 1.")
    if not isinstance(cp_interleave, int) or cp_interleave < 1:
        raise ValueError(
            f"cp_interleave={cp_interleave!r} is invalid: the interleave size must be an int >= 1.")
    if cp_rank is not None and (not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size):
        raise ValueError(
            f"cp_rank={cp_rank!r} is invalid: it must be an int in [0, cp_size={cp_size}).")


def _local_lens(seq_lens: torch.Tensor, cp_size: int, rank: torch.Tensor | int,
                cp_interleave: int) -> torch.Tensor:
    """Torch form of the local-length formula; `rank` may be an int or a broadcastable tensor."""
    span = cp_size * cp_interleave
    full_rounds = torch.div(seq_lens, span, rounding_mode="floor")
    remainder = seq_lens - full_rounds * span
    partial = (remainder - rank * cp_interleave).clamp(min=0, max=cp_interleave)
    return full_rounds * cp_interleave + partial


def get_dcp_local_seq_lens(seq_lens: torch.Tensor, dcp_size: int = 1, dcp_rank: int | None = None,
                           interleave: int = 1) -> torch.Tensor:
    """Rank-local lengths of global `seq_lens` [B].

    Returns [B] for one rank, or [B, dcp_size] (column r = rank r) when `dcp_rank` is None.
    The result keeps the dtype and device of `seq_lens` (a Python list becomes int64).
    """
    _check_geometry(dcp_size, dcp_rank, interleave)
    if not isinstance(seq_lens, torch.Tensor):
        seq_lens = torch.as_tensor(seq_lens, dtype=torch.int64)
    if seq_lens.is_floating_point():
        raise ValueError(f"seq_lens has dtype {seq_lens.dtype}; pass an integer tensor.")
    if dcp_rank is not None:
        return _local_lens(seq_lens, dcp_size, dcp_rank, interleave).to(seq_lens.dtype)
    ranks = torch.arange(dcp_size, device=seq_lens.device, dtype=seq_lens.dtype)
    return _local_lens(seq_lens.unsqueeze(-1), dcp_size, ranks, interleave).to(seq_lens.dtype)


def dcp_local_seq_lens_np(seq_lens: np.ndarray, cp_size: int, cp_rank: int, cp_interleave: int,
                          out: np.ndarray) -> np.ndarray:
    """Host (numpy) twin of `get_dcp_local_seq_lens` for one rank, written into `out[:B]` (a
    persistent host buffer: host planners read it) without torch ops. Returns out[:B]."""
    _check_geometry(cp_size, cp_rank, cp_interleave)
    n = seq_lens.shape[0]
    lens = np.asarray(seq_lens, dtype=np.int64)
    span = cp_size * cp_interleave
    full_rounds = lens // span
    partial = np.clip(lens - full_rounds * span - cp_rank * cp_interleave, 0, cp_interleave)
    np.add(full_rounds * cp_interleave, partial, out=out[:n], casting="unsafe")
    return out[:n]


if HAS_TRITON:

    @triton.jit
    def slot_geometry_tl(pos, block_size, group_cp, group_rank, cp_interleave):
        """The Triton form of `_slot_geometry` for int64 positions (inlined into the slot-mapping,
        step-preparation and block-draft kernels, so the three share one slot formula): (virtual
        block index, owned by `group_rank` of `group_cp`, local offset in the physical block)."""
        virtual_block = block_size * group_cp
        block_index = pos // virtual_block
        offset = pos - block_index * virtual_block
        owned = ((offset // cp_interleave) % group_cp) == group_rank
        local_offset = (offset // (cp_interleave * group_cp)) * cp_interleave \
            + offset % cp_interleave
        return block_index, owned, local_offset

    # Per-step counts are not specialised on (one compiled variant, no JIT mid-serving).
    @triton.jit(do_not_specialize=["num_reqs", "num_rows"])
    def _dcp_local_seq_lens_kernel(out_ptr, seq_lens_ptr, num_reqs, num_rows, cp_size, cp_rank,
                                   cp_interleave, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        active = rows < num_reqs
        seq_len = tl.load(seq_lens_ptr + rows, mask=active, other=0).to(tl.int64)
        span = cp_size * cp_interleave
        full_rounds = seq_len // span
        partial = seq_len - full_rounds * span - cp_rank * cp_interleave
        partial = tl.minimum(tl.maximum(partial, 0), cp_interleave)
        local = tl.where(active, full_rounds * cp_interleave + partial, 0)
        # Rows in [num_reqs, num_rows) are CUDA-graph padding: they must read as empty (0).
        tl.store(out_ptr + rows, local.to(out_ptr.dtype.element_ty), mask=rows < num_rows)


def _check_prepare_args(out: torch.Tensor, seq_lens: torch.Tensor, num_reqs: int) -> None:
    if out.dim() != 1 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous 1-D buffer, got shape {tuple(out.shape)}.")
    if out.is_floating_point() or seq_lens.is_floating_point():
        raise ValueError(
            f"out ({out.dtype}) and seq_lens ({seq_lens.dtype}) must be integer tensors.")
    if not 0 <= num_reqs <= out.numel():
        raise ValueError(
            f"num_reqs={num_reqs} is invalid: it must be in [0, out.numel()={out.numel()}].")
    if num_reqs > seq_lens.numel():
        raise ValueError(
            f"num_reqs={num_reqs} exceeds seq_lens.numel()={seq_lens.numel()}; "
            "pass the full seq_lens buffer.")
    if out.device != seq_lens.device:
        raise ValueError(f"out is on {out.device} but seq_lens is on {seq_lens.device}.")


def _prepare_torch(out, seq_lens, num_reqs, cp_size, cp_rank, cp_interleave) -> None:
    if num_reqs > 0:
        local = _local_lens(seq_lens[:num_reqs].to(torch.int64), cp_size, cp_rank, cp_interleave)
        out[:num_reqs].copy_(local)
    out[num_reqs:].zero_()


def _prepare_triton(out, seq_lens, num_reqs, cp_size, cp_rank, cp_interleave) -> None:
    block = 128
    grid = (max(triton.cdiv(out.numel(), block), 1),)
    _dcp_local_seq_lens_kernel[grid](out, seq_lens, num_reqs, out.numel(), cp_size, cp_rank,
                                     cp_interleave, BLOCK=block)


def prepare_dcp_local_seq_lens(out: torch.Tensor, seq_lens: torch.Tensor, num_reqs: int,
                               cp_size: int, cp_rank: int, cp_interleave: int) -> None:
    """Write local(seq_lens[i], cp_rank) into out[i] for i < num_reqs and zero every later row.

    `out` is the persistent int32 buffer (written in place, same data_ptr); `seq_lens` holds the
    global lengths (rows past num_reqs are ignored).
    """
    _check_geometry(cp_size, cp_rank, cp_interleave)
    _check_prepare_args(out, seq_lens, num_reqs)
    if out.is_cuda and HAS_TRITON:
        _prepare_triton(out, seq_lens, num_reqs, cp_size, cp_rank, cp_interleave)
    else:
        _prepare_torch(out, seq_lens, num_reqs, cp_size, cp_rank, cp_interleave)


def _slot_geometry(positions: torch.Tensor, block_size: int, cp_size: int, cp_rank: int,
                   cp_interleave: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(virtual block index, owned by cp_rank, local offset in the physical block) of int64
    global `positions` -- the torch form of the slot formula (the Triton kernel mirrors it)."""
    virtual_block = block_size * cp_size
    block_index = torch.div(positions, virtual_block, rounding_mode="floor")
    offset = positions - block_index * virtual_block
    owned = torch.div(offset, cp_interleave, rounding_mode="floor") % cp_size == cp_rank
    local_offset = (torch.div(offset, cp_interleave * cp_size, rounding_mode="floor") * cp_interleave
                    + offset % cp_interleave)
    return block_index, owned, local_offset


def cp_local_slot(positions: torch.Tensor, block_table_row: torch.Tensor, block_size: int,
                  cp_size: int, cp_rank: int, cp_interleave: int) -> torch.Tensor:
    """Cache slot on `cp_rank` of each global position of one request, -1 (PAD) where another
    rank stores it.

    A block id covers a virtual block of block_size * cp_size global tokens; every rank uses the
    same block ids and keeps its share of the virtual block in its own physical block.
    Returns int64 slots shaped like `positions`.
    """
    _check_geometry(cp_size, cp_rank, cp_interleave)
    if block_size < 1 or block_size % cp_interleave != 0:
        raise ValueError(
            f"block_size={block_size} is invalid: it must be a positive multiple of "
            f"cp_interleave={cp_interleave}.")
    positions = torch.as_tensor(positions).to(torch.int64)
    block_table_row = torch.as_tensor(block_table_row, device=positions.device)
    block_index, owned, local_offset = _slot_geometry(positions, block_size, cp_size, cp_rank,
                                                      cp_interleave)
    if positions.numel() > 0 and (positions.min() < 0 or block_index.max() >= block_table_row.numel()):
        raise ValueError(
            f"positions span [{int(positions.min())}, {int(positions.max())}] but the block table "
            f"row covers only {block_table_row.numel()} virtual blocks of "
            f"{block_size * cp_size} tokens.")
    block_ids = block_table_row.to(torch.int64)[block_index]
    slots = block_ids * block_size + local_offset
    return torch.where(owned, slots, torch.full_like(slots, -1))
