"""Verification of draft tokens against the target model.

Layout: request i verifies `n_i = len(draft_token_ids[i])` drafts with `n_i + 1` consecutive rows of
`target_logits`: row j (< n_i) is the target's distribution for draft j, row n_i is the bonus row.
A request with no drafts (prefill, plain decode) has one row and simply samples from it.

Methods
- "strict": draw the target's own token at each row (argmax for greedy requests, a sample from p
  otherwise); accept drafts while they equal it; emit the target token at the first mismatch, or
  the bonus-row token after full acceptance. Exact for any draft distribution.
- "probabilistic": standard speculative sampling. Accept draft x with probability min(1, p(x)/q(x));
  on rejection emit a sample of normalize(max(p - q, 0)); after full acceptance sample the bonus
  from p. q comes from `draft_probs`, or is one-hot on the draft (greedy drafters) when None.
Greedy requests (temperature 0) use argmax matching under both methods: p is one-hot there, so
speculative sampling reduces to it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm.v1.sample.metadata import SAMPLING_EPS, SamplingMetadata
from vllm.v1.sample.sampler import compute_probs, random_sample

REJECTION_METHODS = ("strict", "probabilistic")


@dataclass
class RejectionSamplerOutput:
    sampled_token_ids: list[list[int]]  # accepted drafts + one bonus/corrected token, per request
    num_draft_tokens: list[int]
    num_accepted_tokens: list[int]


class RejectionSampler:

    def __init__(self, method: str = "strict"):
        if method not in REJECTION_METHODS:
            raise ValueError(f"rejection_sample_method={method!r} is not supported; use one of "
                             f"{REJECTION_METHODS}")
        self.method = method

    def __call__(self, target_logits: torch.Tensor, draft_token_ids: Sequence[Sequence[int]],
                 sampling_metadata: SamplingMetadata,
                 draft_probs: torch.Tensor | None = None) -> RejectionSamplerOutput:
        return self.forward(target_logits, draft_token_ids, sampling_metadata, draft_probs)

    def forward(self, target_logits: torch.Tensor, draft_token_ids: Sequence[Sequence[int]],
                sampling_metadata: SamplingMetadata,
                draft_probs: torch.Tensor | None = None) -> RejectionSamplerOutput:
        md = sampling_metadata
        drafts = [list(map(int, d)) for d in draft_token_ids]
        num_drafts = [len(d) for d in drafts]
        num_reqs = len(drafts)
        if md.num_reqs != num_reqs:
            raise ValueError(f"sampling metadata has {md.num_reqs} rows but {num_reqs} requests "
                             "have draft lists; pass one (possibly empty) draft list per request")
        row_starts = [0]
        for n in num_drafts:
            row_starts.append(row_starts[-1] + n + 1)
        num_rows = row_starts[-1]
        if target_logits.dim() != 2 or target_logits.shape[0] != num_rows:
            raise ValueError(f"target_logits must be [sum(num_drafts + 1)={num_rows}, vocab]; got "
                             f"{tuple(target_logits.shape)}")
        total_drafts = sum(num_drafts)
        if draft_probs is not None and tuple(draft_probs.shape) != (total_drafts, target_logits.shape[1]):
            raise ValueError(f"draft_probs must be [total drafts={total_drafts}, vocab="
                             f"{target_logits.shape[1]}]; got {tuple(draft_probs.shape)}")

        device = target_logits.device
        # Row index of every draft within target_logits (all rows except each request's last).
        draft_rows = torch.tensor([row_starts[i] + j for i, n in enumerate(num_drafts) for j in range(n)],
                                  dtype=torch.int64, device=device)
        draft_tokens = torch.tensor([t for d in drafts for t in d], dtype=torch.int64, device=device)

        greedy_tokens = target_logits.argmax(dim=-1)
        if md.all_greedy:
            accepted = draft_tokens == greedy_tokens[draft_rows]
            emitted = greedy_tokens
        else:
            # Request of every row (only random verification needs it).
            row_req = torch.repeat_interleave(
                torch.arange(num_reqs, device=device),
                torch.tensor([n + 1 for n in num_drafts], device=device), output_size=num_rows)
            accepted, emitted = self._random_verify(target_logits, md, row_req, row_starts, draft_rows,
                                                    draft_tokens, draft_probs)
            if not md.all_random:
                greedy_row = (md.temperature < SAMPLING_EPS)[row_req]
                accepted = torch.where(greedy_row[draft_rows], draft_tokens == greedy_tokens[draft_rows],
                                       accepted)
                emitted = torch.where(greedy_row, greedy_tokens, emitted)

        accepted_list = accepted.tolist()
        emitted_list = emitted.tolist()
        sampled, num_accepted = [], []
        draft_offset = 0
        for i, n in enumerate(num_drafts):
            k = 0
            while k < n and accepted_list[draft_offset + k]:
                k += 1
            sampled.append(drafts[i][:k] + [emitted_list[row_starts[i] + k]])
            num_accepted.append(k)
            draft_offset += n
        return RejectionSamplerOutput(sampled, num_drafts, num_accepted)

    def _random_verify(self, target_logits, md: SamplingMetadata, row_req, row_starts, draft_rows,
                       draft_tokens, draft_probs):
        """(accepted [total drafts] bool, emitted token per row [num_rows]) for random requests."""
        top_k = md.top_k[row_req] if md.top_k is not None else None
        top_p = md.top_p[row_req] if md.top_p is not None else None
        probs = compute_probs(target_logits, md.temperature[row_req], top_k, top_p)
        if self.method == "strict":
            target_tokens = random_sample(probs, md.generators, row_starts)
            return draft_tokens == target_tokens[draft_rows], target_tokens

        p_draft = probs[draft_rows, draft_tokens]
        draft_probs_on_rows = draft_probs.float() if draft_probs is not None else None
        if draft_probs_on_rows is None:
            q_draft = torch.ones_like(p_draft)
            residual = probs[draft_rows].scatter(1, draft_tokens.unsqueeze(1), 0.0)
        else:
            q_draft = draft_probs_on_rows.gather(1, draft_tokens.unsqueeze(1)).squeeze(1)
            residual = (probs[draft_rows] - draft_probs_on_rows).clamp_min(0.0)
        # A residual with no mass can only occur where p >= q, i.e. where the draft is always
        # accepted; fall back to p there so the (unused) sample stays well defined.
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, probs[draft_rows], residual)
        uniforms = self._draft_uniforms(p_draft, md.generators, row_starts)
        accepted = uniforms * q_draft < p_draft
        recovery = probs.clone()
        recovery[draft_rows] = residual
        return accepted, random_sample(recovery, md.generators, row_starts)

    @staticmethod
    def _draft_uniforms(like: torch.Tensor, generators: dict[int, torch.Generator], row_starts):
        """U[0,1) per draft; request i's come from its generator (drawn before its recovery noise)."""
        uniforms = torch.rand(like.shape, device=like.device)
        for req, gen in generators.items():
            # Draft offsets are row offsets minus one bonus row per earlier request.
            lo = row_starts[req] - req
            hi = row_starts[req + 1] - (req + 1)
            if hi > lo:
                uniforms[lo:hi] = torch.rand(hi - lo, device=like.device, generator=gen)
        return uniforms
