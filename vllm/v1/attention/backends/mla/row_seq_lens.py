"""One Triton launch for the per-row decode geometry of MLACommonMetadataBuilder._row_seq_lens.

For every decode query token t < num_tokens it writes
  req[t] = the decode row t belongs to (binary search over query_start_loc; rows past the last
           block are CUDA-graph padding and take the last block's index),
  pos[t] = t - query_start_loc[req[t]] (index inside its block),
  out[t] = visible KV count on this rank: the caller's rank-local length of the row's sequence,
           or, for the earlier rows of a causal block, local(G - (Q-1-j)) from the GLOBAL bound
           (DESIGN §2); 0 for padding tokens.
The torch form in common.py is the reference (and the CPU path); this kernel replaces its dozen
small launches on the host-bound decode step. The DCP formula is cp_utils' local length.
"""
from __future__ import annotations

import torch

from vllm.triton_utils import HAS_TRITON, tl, triton
from vllm.utils.triton_launch import LeanLaunch

# Halvings of the binary search: fixed (one compiled variant) and enough for 65535 decode rows.
_SEARCH_STEPS = 16

if HAS_TRITON:

    @triton.jit(do_not_specialize=["num_decodes", "num_tokens"])
    def _row_seq_lens_kernel(out_ptr, req_ptr, pos_ptr, qsl_ptr, local_ptr, global_ptr,
                             num_decodes, num_tokens, cp_size, cp_rank, cp_interleave,
                             CAUSAL: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                             BLOCK: tl.constexpr):
        tok = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        in_range = tok < num_tokens
        # req = number of block ends <= tok (searchsorted(qsl[1:], tok, right=True))
        lo = tl.zeros([BLOCK], dtype=tl.int32)
        hi = tl.zeros([BLOCK], dtype=tl.int32) + num_decodes
        for _ in range(SEARCH_STEPS):
            active = lo < hi
            mid = (lo + hi) // 2
            end = tl.load(qsl_ptr + 1 + mid, mask=active & in_range, other=0)
            right = active & (end <= tok)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(active & (end > tok), mid, hi)
        live = lo < num_decodes
        req = tl.minimum(lo, num_decodes - 1)
        start = tl.load(qsl_ptr + req, mask=in_range, other=0)
        pos = tok - start
        whole = tl.load(local_ptr + req, mask=in_range, other=0).to(tl.int64)
        if CAUSAL:
            stop = tl.load(qsl_ptr + req + 1, mask=in_range, other=0)
            offset = (stop - start - 1 - pos).to(tl.int64)
            g = tl.load(global_ptr + req, mask=in_range, other=0).to(tl.int64) - offset
            span = cp_size * cp_interleave
            rounds = g // span
            partial = g - rounds * span - cp_rank * cp_interleave
            partial = tl.minimum(tl.maximum(partial, 0), cp_interleave)
            bounded = rounds * cp_interleave + partial
            whole = tl.where(offset > 0, bounded, whole)
        whole = tl.where(live, whole, 0)
        tl.store(out_ptr + tok, whole.to(out_ptr.dtype.element_ty), mask=in_range)
        tl.store(req_ptr + tok, req.to(tl.int64), mask=in_range)
        tl.store(pos_ptr + tok, pos.to(tl.int64), mask=in_range)


# Through LeanLaunch (vllm/utils/triton_launch.py; off unless VLLM_LEAN_TRITON_LAUNCH=1).
_ROW_SEQ_LENS_LAUNCH = LeanLaunch(_row_seq_lens_kernel) if HAS_TRITON else None


def row_seq_lens_triton(out: torch.Tensor, req_out: torch.Tensor, pos_out: torch.Tensor,
                        query_start_loc: torch.Tensor, local_seq_lens: torch.Tensor,
                        global_seq_lens: torch.Tensor, num_decodes: int, num_tokens: int,
                        causal: bool, cp_size: int, cp_rank: int, cp_interleave: int) -> None:
    """Fill out/req_out/pos_out[:num_tokens] (num_decodes >= 1, num_tokens >= 1)."""
    block = 128
    if not 1 <= num_decodes < 2 ** _SEARCH_STEPS:
        raise ValueError(f"num_decodes={num_decodes} must lie in [1, {2 ** _SEARCH_STEPS})")
    _ROW_SEQ_LENS_LAUNCH(
        (triton.cdiv(num_tokens, block),), out, req_out, pos_out, query_start_loc,
        local_seq_lens, global_seq_lens, num_decodes, num_tokens, cp_size, cp_rank,
        cp_interleave, CAUSAL=bool(causal), SEARCH_STEPS=_SEARCH_STEPS, BLOCK=block)
