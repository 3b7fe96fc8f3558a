"""Logprobs of sampled tokens: the top-k of each row plus the sampled token and its rank.

Shapes follow upstream (vllm.v1.outputs.LogprobsTensors / LogprobsLists): column 0 is the sampled
token, columns 1..k the top-k tokens in descending order; the rank is 1-based and counts the
tokens whose logprob is >= the sampled token's (ties rank ahead, as upstream). Logprobs are the
log_softmax of the model's raw logits in float32 (upstream's default logprobs_mode raw_logprobs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogprobsLists:
    logprob_token_ids: list[list[int]]  # [N][k + 1]
    logprobs: list[list[float]]  # [N][k + 1]
    sampled_token_ranks: list[int]  # [N]

    def slice(self, start: int, end: int) -> "LogprobsLists":
        return LogprobsLists(self.logprob_token_ids[start:end], self.logprobs[start:end],
                             self.sampled_token_ranks[start:end])

    def __len__(self) -> int:
        return len(self.sampled_token_ranks)


@dataclass
class LogprobsTensors:
    logprob_token_ids: torch.Tensor  # [N, k + 1] int64
    logprobs: torch.Tensor  # [N, k + 1] float32
    selected_token_ranks: torch.Tensor  # [N] int64

    def tolists(self) -> LogprobsLists:
        return LogprobsLists(self.logprob_token_ids.tolist(), self.logprobs.tolist(),
                             self.selected_token_ranks.tolist())


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int,
                    token_ids: torch.Tensor) -> LogprobsTensors:
    """logprobs [N, V] float32, token_ids [N] int64 -> top-`num_logprobs` + the given tokens.
    num_logprobs -1 means the whole vocabulary."""
    vocab = logprobs.shape[-1]
    k = vocab if num_logprobs == -1 else int(num_logprobs)
    if not 0 <= k <= vocab:
        raise ValueError(f"num_logprobs={num_logprobs} is invalid: it must be in [0, {vocab}] or "
                         "-1 (whole vocabulary)")
    token_ids = token_ids.to(torch.int64)
    token_lp = logprobs.gather(-1, token_ids.unsqueeze(-1))
    ranks = (logprobs >= token_lp).sum(dim=-1)
    if k:
        top_lp, top_ids = torch.topk(logprobs, k, dim=-1)
        ids = torch.cat([token_ids.unsqueeze(-1), top_ids], dim=1)
        lps = torch.cat([token_lp, top_lp], dim=1)
    else:
        ids, lps = token_ids.unsqueeze(-1), token_lp
    return LogprobsTensors(ids, lps, ranks)
