"""Token sampling: greedy rows take the argmax; random rows apply temperature, top-k, top-p, then draw.

Draws use the exponential race (argmax of p_i / E_i with E_i ~ Exp(1) picks i with probability p_i),
which needs no sort and lets each request draw its noise from its own generator.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm.v1.sample.metadata import SAMPLING_EPS, SamplingMetadata
from vllm.v1.sample.topk_topp import apply_top_k_top_p

# Exp(1) noise can be exactly 0 in float32; a floor keeps p/E finite and p=0 tokens unpickable.
_MIN_NOISE = 1e-30


def compute_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                  top_p: torch.Tensor | None) -> torch.Tensor:
    """Softmax of temperature-scaled, top-k/top-p masked logits (float32). Greedy rows use T=1."""
    temp = torch.where(temperature < SAMPLING_EPS, torch.ones_like(temperature), temperature)
    scaled = logits.float() / temp.unsqueeze(1)
    scaled = apply_top_k_top_p(scaled, top_k, top_p)
    return scaled.softmax(dim=-1)


def exponential_noise(shape_like: torch.Tensor, generators: dict[int, torch.Generator],
                      row_starts: Sequence[int] | None = None) -> torch.Tensor:
    """Exp(1) noise shaped like `shape_like`; request i's rows come from generators[i] if present.

    row_starts: cumulative row offsets per request ([0, r0, r0+r1, ...]); None = one row per request.
    """
    noise = torch.empty_like(shape_like, dtype=torch.float32)
    noise.exponential_()
    for req, gen in generators.items():
        lo, hi = (req, req + 1) if row_starts is None else (row_starts[req], row_starts[req + 1])
        if hi > lo:
            noise[lo:hi].exponential_(generator=gen)
    return noise.clamp_min_(_MIN_NOISE)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator],
                  row_starts: Sequence[int] | None = None) -> torch.Tensor:
    """One token per row drawn from `probs` (rows need not be normalised)."""
    return (probs / exponential_noise(probs, generators, row_starts)).argmax(dim=-1)


class Sampler:
    """logits [num_reqs, V] -> sampled token ids [num_reqs] (int64, same device)."""

    def __call__(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> torch.Tensor:
        return self.forward(logits, sampling_metadata)

    def forward(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> torch.Tensor:
        if logits.dim() != 2 or logits.shape[0] != sampling_metadata.num_reqs:
            raise ValueError(
                f"logits must be [num_reqs={sampling_metadata.num_reqs}, vocab]; got "
                f"{tuple(logits.shape)}: pass one logits row per request")
        greedy_tokens = logits.argmax(dim=-1)
        if sampling_metadata.all_greedy:
            return greedy_tokens
        md = sampling_metadata
        probs = compute_probs(logits, md.temperature, md.top_k, md.top_p)
        random_tokens = random_sample(probs, md.generators)
        if md.all_random:
            return random_tokens
        return torch.where(md.temperature < SAMPLING_EPS, greedy_tokens, random_tokens)
