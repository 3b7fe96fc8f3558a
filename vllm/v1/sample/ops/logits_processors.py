"""Per-row logits processors (upstream semantics): logit_bias, allowed-token and bad-word masks,
min_tokens (EOS / stop tokens held back) and min_p. Pure tensor ops on [R, V] rows."""
from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_logit_bias(logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """bias [R, V] float (0 where a request gave none) is added to the logits."""
    return logits.float() + bias.to(torch.float32)


def apply_token_mask(logits: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """banned [R, V] bool: those tokens get -inf (allowed_token_ids complement, bad words)."""
    return logits.masked_fill(banned, _NEG_INF)


def apply_min_tokens(logits: torch.Tensor, num_output_tokens: torch.Tensor,
                     min_tokens: torch.Tensor, stop_mask: torch.Tensor) -> torch.Tensor:
    """Rows whose output is still shorter than min_tokens cannot pick a stop token.

    num_output_tokens [R]: tokens the row's request has generated before this row (verification
    rows count the drafts before them); min_tokens [R]; stop_mask [R, V] bool (EOS + stop ids).
    """
    too_short = (num_output_tokens < min_tokens).unsqueeze(1)
    return logits.masked_fill(too_short & stop_mask, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability (after temperature) is below min_p * the top probability.

    Greedy rows (temperature 0) are left alone: the argmax always survives min_p. Expressed on
    logits: p_t < min_p * p_max  <=>  logit_t / T < logit_max / T + log(min_p).
    """
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).unsqueeze(1)
    scaled = logits.float() / temp
    top = scaled.max(dim=-1, keepdim=True).values
    threshold = top + torch.log(min_p.to(torch.float32).clamp_min(1e-30)).unsqueeze(1)
    active = ((min_p > 0) & (temperature > 0)).unsqueeze(1)
    return logits.masked_fill(active & (scaled < threshold), _NEG_INF)
