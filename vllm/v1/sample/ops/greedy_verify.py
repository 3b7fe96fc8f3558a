"""Greedy verification of an eager (not graph-replayed) step in one launch.

For a step whose sampling rows all decode greedily with no logits processing, the rejection
sampler's result is a pure function of the target's argmax per logits row and the slot-indexed
drafts: the accepted prefix ends at the first draft that differs from the argmax, and the emitted
token is the argmax right after it. `greedy_verify_triton` computes, per sampling row, the
accepted count, the packed step-output row (argmax tokens up to and including the emitted one,
-1 after, the count in the last column) and the next step's anchor (`last_sampled[slot]`), for
ragged rows (any number of drafts per row, rows without drafts, rows that do not sample). On the
host that replaces the two dozen small launches of the general verification (index staging,
grids, cumprod, gathers, the last_sampled scatter and the two packing copies) by one.
`greedy_verify_torch` is its twin (CPU path and the reference of the kernel's tests).

Layout (the input batch's): batch row r owns logits rows [cu[r], cu[r + 1]); a row verifying n
drafts has n + 1 of them (row i is the target's token for draft i, row n the bonus), a sampling
row without drafts has one, a row that does not sample has none. Sampling row j is batch row
rows[j]; its drafts are draft_tokens[slots[rows[j]], :n].
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # pragma: no cover - the CPU box has triton; a bare install may not
    HAS_TRITON = False


if HAS_TRITON:

    # The per-step count is not specialised on (a JIT build mid-serving for each new batch size
    # class otherwise).
    @triton.jit(do_not_specialize=["num_sample_rows"])
    def _greedy_verify_kernel(greedy_ptr, cu_ptr, slots_ptr, rows_ptr, drafts_ptr, drafts_stride,
                              last_sampled_ptr, out_ptr, out_stride, num_sample_rows,
                              K: tl.constexpr, BLOCK: tl.constexpr):
        j = tl.program_id(0)
        if j < num_sample_rows:
            r = tl.load(rows_ptr + j).to(tl.int64)
            start = tl.load(cu_ptr + r).to(tl.int64)
            n_logits = tl.load(cu_ptr + r + 1).to(tl.int64) - start
            slot = tl.load(slots_ptr + r).to(tl.int64)
            i = tl.arange(0, BLOCK)
            g = tl.load(greedy_ptr + start + i, mask=i < n_logits, other=-1).to(tl.int64)
            # drafts verified by this row: the first n_logits - 1 columns of its slot
            is_draft = (i < n_logits - 1) & (i < K)
            d = tl.load(drafts_ptr + slot * drafts_stride + i, mask=is_draft, other=-1)
            mismatch = (g != d.to(tl.int64)) | (is_draft == 0)
            num_accepted = tl.min(tl.where(mismatch, i, BLOCK), axis=0).to(tl.int64)
            emitted = tl.sum(tl.where(i == num_accepted, g, 0), axis=0)
            tl.store(out_ptr + j * out_stride + i, tl.where(i <= num_accepted, g, -1),
                     mask=i < K + 1)
            tl.store(out_ptr + j * out_stride + K + 1, num_accepted + 1)
            tl.store(last_sampled_ptr + slot, emitted)


def greedy_verify_triton(greedy: torch.Tensor, cu_num_logits: torch.Tensor, slots: torch.Tensor,
                         rows: torch.Tensor, draft_tokens: torch.Tensor,
                         last_sampled: torch.Tensor, out: torch.Tensor,
                         num_sample_rows: int) -> None:
    """greedy [N] argmax per logits row; cu_num_logits [B + 1]; slots [B] (batch row -> slot);
    rows [>= S] (sampling row -> batch row); draft_tokens [slots, k]; last_sampled [slots (+1)];
    out [>= S, k + 2] int64 (tokens, then -1, count in the last column)."""
    k = draft_tokens.shape[1]
    if out.shape[1] != k + 2:
        raise ValueError(f"out has {out.shape[1]} columns; the drafts need k + 2 = {k + 2}")
    if num_sample_rows == 0:
        return
    _greedy_verify_kernel[(num_sample_rows,)](
        greedy, cu_num_logits, slots, rows, draft_tokens, draft_tokens.stride(0), last_sampled,
        out, out.stride(0), num_sample_rows, K=k, BLOCK=triton.next_power_of_2(k + 1))


def greedy_verify_torch(greedy: torch.Tensor, cu_num_logits: torch.Tensor, slots: torch.Tensor,
                        rows: torch.Tensor, draft_tokens: torch.Tensor,
                        last_sampled: torch.Tensor, out: torch.Tensor,
                        num_sample_rows: int) -> None:
    """The kernel's twin in torch ops: writes exactly what the kernel writes."""
    k = draft_tokens.shape[1]
    if out.shape[1] != k + 2:
        raise ValueError(f"out has {out.shape[1]} columns; the drafts need k + 2 = {k + 2}")
    S = num_sample_rows
    if S == 0:
        return
    i64 = torch.int64
    r = rows[:S].to(i64)
    start = cu_num_logits[r].to(i64)
    n_logits = cu_num_logits[r + 1].to(i64) - start
    col = torch.arange(k + 1, dtype=i64, device=greedy.device)
    live = col < n_logits[:, None]
    # reads past a row's logits are masked (the clamp keeps them inside the tensor)
    g = torch.where(live, greedy[(start[:, None] + col).clamp(max=max(greedy.shape[0] - 1, 0))],
                    -1)
    slot = slots[r].to(i64)
    match = (g[:, :k] == draft_tokens[slot].to(i64)) & (col[:k] < n_logits[:, None] - 1)
    num_accepted = match.to(i64).cumprod(dim=1).sum(dim=1)
    out[:S, : k + 1].copy_(torch.where(col <= num_accepted[:, None], g, -1))
    out[:S, k + 1].copy_(num_accepted + 1)
    last_sampled[slot] = g.gather(1, num_accepted[:, None]).squeeze(1)
