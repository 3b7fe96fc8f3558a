"""The torch form of DSpark's greedy Markov draft chain (DSparkSpeculator.select_drafts with
argmax) and its bias-table form, and a check that a chain of drafts is a greedy choice at every
position: shared by the interpreter driver and the GPU test of markov_greedy.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def torch_chain(logits: torch.Tensor, anchors: torch.Tensor, w1: torch.Tensor,
                w2: torch.Tensor) -> torch.Tensor:
    """The speculator's torch ops, position by position (embedding, linear, cast, add, argmax)."""
    drafts = torch.empty(logits.shape[0], logits.shape[1], dtype=torch.int64,
                         device=logits.device)
    previous = anchors
    for j in range(logits.shape[1]):
        bias = F.linear(F.embedding(previous, w1), w2)
        previous = (logits[:, j, :] + bias.to(logits.dtype)).argmax(dim=-1)
        drafts[:, j] = previous
    return drafts


def table_chain(logits: torch.Tensor, anchors: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The chain from the head's bias table (row p: the bias after token p, in the logits'
    dtype), in torch ops: what markov_table_drafts must return exactly."""
    drafts = torch.empty(logits.shape[0], logits.shape[1], dtype=torch.int64,
                         device=logits.device)
    previous = anchors
    for j in range(logits.shape[1]):
        previous = (logits[:, j, :] + table[previous]).argmax(dim=-1)
        drafts[:, j] = previous
    return drafts


def greedy_gaps(drafts: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor,
                w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Along `drafts`' own chain (each position's previous token is the chain's), how far each
    chosen token's biased logit (computed in float64) is below the position's maximum: 0 where
    the chain is an exact greedy choice; [B, K] float64."""
    w1, w2, lg = w1.double(), w2.double(), logits.double()
    previous = anchors
    gaps = torch.empty(drafts.shape, dtype=torch.float64, device=drafts.device)
    for j in range(drafts.shape[1]):
        biased = lg[:, j, :] + F.linear(F.embedding(previous, w1), w2)
        chosen = drafts[:, j]
        gaps[:, j] = biased.max(dim=-1).values - biased.gather(1, chosen[:, None])[:, 0]
        previous = chosen
    return gaps


def greedy_gap_bounds(drafts: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor,
                      w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Along `drafts`' own chain, the largest gap (greedy_gaps) that rounding alone explains:
    the chain rounds the bias to the head's dtype and the biased logit to the logits' dtype,
    each with an error of at most u * |value| (u: the dtype's unit roundoff), on the chosen
    token and on the true maximum alike, so gap <= 2 * (u_head * max|bias| + u_logits *
    max|biased logit|) per position; float32 accumulation over the rank is orders of magnitude
    below that. [B, K] float64."""
    u_head = torch.finfo(w2.dtype).eps / 2
    u_logits = torch.finfo(logits.dtype).eps / 2
    w1, w2, lg = w1.double(), w2.double(), logits.double()
    previous = anchors
    bounds = torch.empty(drafts.shape, dtype=torch.float64, device=drafts.device)
    for j in range(drafts.shape[1]):
        bias = F.linear(F.embedding(previous, w1), w2)
        biased = lg[:, j, :] + bias
        bounds[:, j] = 2 * (u_head * bias.abs().amax(dim=-1)
                            + u_logits * biased.abs().amax(dim=-1))
        previous = drafts[:, j]
    return bounds
