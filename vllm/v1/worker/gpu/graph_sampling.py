"""Greedy verification captured with the model forward (uniform decode / verify graphs).

For a uniform batch (every row Q = 1 + k tokens, trailing zero-length padding rows) whose
requests all decode greedily with no logits processing, what `_sample` computes is a pure
function of the logits and the slot-indexed device state: the argmax of every row, the accepted
prefix of the drafts (first mismatch with the argmax), the emitted token (the argmax right after
the accepted prefix) and the packed step output. Capturing it in the step's graph removes two
dozen small launches from the host-bound step. The runner uses the captured result only when its
host-side checks say the eager path would compute the same thing (all greedy, no penalties, bans,
biases, min_tokens); otherwise the eager path runs after the replay and overwrites what the graph
wrote (last_sampled and the packed rows), in stream order.
"""
from __future__ import annotations

import torch


def captured_greedy_step(logits: torch.Tensor, num_rows: int, query_len: int,
                         slots: torch.Tensor, query_start_loc: torch.Tensor,
                         draft_tokens: torch.Tensor, last_sampled: torch.Tensor,
                         scratch_slot: int, out: torch.Tensor) -> None:
    """logits [num_rows * query_len, V]; slots [num_rows] (padding rows: any slot);
    query_start_loc [num_rows + 1] device (padding rows have zero length); draft_tokens
    [max_reqs, >= k]; last_sampled [max_reqs + 1] (index scratch_slot takes the padding rows'
    writes); out [>= num_rows, k + 2] int64: tokens in [:, :query_len], count in [:, -1]."""
    greedy = logits.argmax(dim=-1).view(num_rows, query_len)
    k = query_len - 1
    if k > 0:
        drafts = draft_tokens[slots, :k]
        num_accepted = (drafts == greedy[:, :k]).to(torch.int64).cumprod(dim=1).sum(dim=1)
    else:
        num_accepted = torch.zeros(num_rows, dtype=torch.int64, device=logits.device)
    emitted = greedy.gather(1, num_accepted[:, None]).squeeze(1)
    real = query_start_loc[1:num_rows + 1] > query_start_loc[:num_rows]
    # Real rows have distinct slots; every padding row writes the scratch entry.
    target = torch.where(real, slots, torch.full_like(slots, scratch_slot))
    last_sampled.index_copy_(0, target, emitted)
    out[:num_rows, :query_len].copy_(greedy)
    out[:num_rows, -1].copy_(num_accepted + 1)
