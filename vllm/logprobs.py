"""User-facing logprobs (upstream vllm.logprobs): one dict per token, token id -> Logprob."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank in the vocabulary (ties rank ahead)
    decoded_token: str | None = None


# One dict per generated token: the sampled token first, then the top-k (upstream's order).
SampleLogprobs = list[dict[int, Logprob]]
# The first prompt token has no logprob (None), as upstream.
PromptLogprobs = list[dict[int, Logprob] | None]


def logprobs_row_to_dict(token_ids: list[int], logprobs: list[float], sampled_rank: int,
                         decode=None) -> dict[int, Logprob]:
    """Column 0 is the sampled token (rank `sampled_rank`); columns 1.. the top-k, rank j."""
    out: dict[int, Logprob] = {}
    for j, (tok, lp) in enumerate(zip(token_ids, logprobs)):
        if tok in out:
            continue  # the sampled token is also in the top-k: keep its first (sampled) entry
        out[tok] = Logprob(float(lp), sampled_rank if j == 0 else j,
                           decode(tok) if decode is not None else None)
    return out
