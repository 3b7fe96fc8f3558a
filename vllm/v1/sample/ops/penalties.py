"""Repetition / frequency / presence penalties (upstream semantics and order).

Rows are logits rows (one per sampled or verified position). `output_counts[r, t]` is how often
token t occurs in the row's output so far (for a verification row: the request's output plus the
drafts before that row); `prompt_mask[r, t]` marks tokens of the prompt.

    repetition: seen = prompt or output; logit > 0 -> logit / p, else logit * p
    frequency:  logit -= f * count
    presence:   logit -= p * (count > 0)
"""
from __future__ import annotations

import torch


def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor, prompt_mask: torch.Tensor,
                    presence_penalty: torch.Tensor, frequency_penalty: torch.Tensor,
                    repetition_penalty: torch.Tensor) -> torch.Tensor:
    """logits [R, V] float; counts [R, V] int; prompt_mask [R, V] bool; penalties [R] float.
    Returns a new float32 tensor (the caller's raw logits stay intact for logprobs)."""
    if logits.shape != output_counts.shape or logits.shape != prompt_mask.shape:
        raise ValueError(f"logits {tuple(logits.shape)}, output_counts "
                         f"{tuple(output_counts.shape)} and prompt_mask {tuple(prompt_mask.shape)} "
                         "must have the same [rows, vocab] shape")
    logits = logits.float()
    counts = output_counts.to(torch.float32)
    in_output = output_counts > 0
    rep = repetition_penalty.to(torch.float32).unsqueeze(1)
    seen = in_output | prompt_mask
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency_penalty.to(torch.float32).unsqueeze(1) * counts
    logits = logits - presence_penalty.to(torch.float32).unsqueeze(1) * in_output.to(torch.float32)
    return logits


def segment_draft_counts(row_request_start: torch.Tensor, draft_rows: torch.Tensor,
                         draft_tokens: torch.Tensor, num_rows: int, vocab_size: int) -> torch.Tensor:
    """Counts [num_rows, V] of the drafts that precede each row within its own request.

    A request verifying drafts d_0..d_{n-1} owns rows s..s+n; row s+j has seen d_0..d_{j-1}.
    row_request_start [num_rows]: first row of each row's request; draft_rows [D]: the row of each
    draft (draft j sits at row s+j); draft_tokens [D]. Built with one scatter and one cumsum.
    """
    marks = torch.zeros(num_rows + 1, vocab_size, dtype=torch.int32, device=draft_tokens.device)
    ones = torch.ones_like(draft_tokens, dtype=torch.int32)
    # Draft j becomes visible from row s+j+1 on.
    marks.index_put_((draft_rows + 1, draft_tokens), ones, accumulate=True)
    prefix = marks.cumsum(dim=0, dtype=torch.int32)  # prefix[r] = marks[0..r]
    # Subtract what earlier requests contributed: everything up to row start-1.
    before = torch.where((row_request_start > 0).unsqueeze(1),
                         prefix[(row_request_start - 1).clamp_min(0)],
                         torch.zeros_like(prefix[:num_rows]))
    return prefix[:num_rows] - before
