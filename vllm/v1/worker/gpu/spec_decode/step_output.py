"""Host bookkeeping of a verified speculative step, as whole-array numpy.

The runner's one D2H copy per step yields `host` [S, W]: row j holds the tokens emitted by
sampling row j (accepted drafts + bonus) in its first n_j columns and n_j in its last column.
Per-request Python loops over S rows were the cost here; only the ragged token lists are cut
per row (from one tolist() of the block)."""
from __future__ import annotations

import numpy as np


def apply_verified_step(host: np.ndarray, num_draft: np.ndarray, sample_rows: list[int],
                        num_reqs: int, num_computed_new: np.ndarray,
                        out_tokens: list[list[int]]) -> tuple[list[int], list[int]]:
    """Fill out_tokens[row] for each sampling row, roll num_computed_new (in place) back by
    the rejected drafts, and return per-request (num_draft, num_accepted) lists.
    Sampling rows are distinct batch rows, so the fancy-indexed updates do not collide."""
    num_sample_rows = len(sample_rows)
    n_emit = host[:num_sample_rows, -1].astype(np.int64)
    n_draft = np.asarray(num_draft[:num_sample_rows], dtype=np.int64)
    if num_sample_rows == num_reqs:
        # Every row samples (the steady verify step): the sampling rows are 0..num_reqs-1 in
        # order, so slices replace the fancy indexing and the per-request scatter.
        n_accepted = n_emit - 1
        num_computed_new[:num_reqs] -= n_draft - n_accepted
        for row, (toks, n) in enumerate(zip(host[:num_reqs].tolist(), n_emit.tolist())):
            out_tokens[row] = toks[:n]
        return n_draft.tolist(), n_accepted.tolist()
    rows_np = np.asarray(sample_rows, dtype=np.int64)
    num_computed_new[rows_np] -= n_draft - (n_emit - 1)
    per_req = np.zeros((2, num_reqs), dtype=np.int64)
    per_req[0, rows_np] = n_draft
    per_req[1, rows_np] = n_emit - 1
    for row, toks, n in zip(sample_rows, host[:num_sample_rows].tolist(), n_emit.tolist()):
        out_tokens[row] = toks[:n]
    num_draft_list, num_accepted = per_req.tolist()
    return num_draft_list, num_accepted
