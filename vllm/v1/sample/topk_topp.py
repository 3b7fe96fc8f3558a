"""Top-k and top-p (nucleus) masking of logits, per row, in one sort."""
from __future__ import annotations

import torch


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Return logits with the excluded tokens set to -inf.

    top_k[i] <= 0 or >= vocab disables top-k for row i; ties at the k-th value are all kept.
    top_p[i] >= 1 disables top-p; top-p runs on the top-k survivors and keeps a token iff the
    probability mass of the tokens strictly more likely than it is below p (so at least one token).
    """
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = top_k.to(torch.int64)
        k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
        kth_largest = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_at_or_below = probs.cumsum(dim=-1)
        drop = mass_at_or_below <= (1.0 - top_p.to(probs.dtype)).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
