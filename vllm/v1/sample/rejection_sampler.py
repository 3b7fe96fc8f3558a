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

import numpy as np
import torch

from vllm.v1.sample.metadata import SAMPLING_EPS, SamplingMetadata
from vllm.v1.sample.sampler import compute_probs, random_sample

REJECTION_METHODS = ("strict", "probabilistic")


@dataclass
class RejectionSamplerOutput:
    sampled_token_ids: list[list[int]]  # accepted drafts + one bonus/corrected token, per request
    num_draft_tokens: list[int]
    num_accepted_tokens: list[int]


@dataclass
class DeviceRejectionOutput:
    """Verification results left on the device (the runner copies them to the host once)."""

    sampled: torch.Tensor        # [R, max_drafts + 1] int64: accepted drafts, then the emitted
    #                              token, then -1 padding
    num_accepted: torch.Tensor   # [R] int64
    num_sampled: torch.Tensor    # [R] int64 = num_accepted + 1


def verification_layout(num_drafts: np.ndarray) -> dict[str, np.ndarray]:
    """Host index arrays of one verification batch (numpy, no device data involved).

    Request i owns rows [row_starts[i], row_starts[i] + n_i] of the target logits (n_i drafts plus
    the bonus row). Returns row_starts [R+1], draft_rows [D] (row of every draft), draft_req [D]
    and draft_pos [D] (request and index of every draft), row_req [N] (request of every row).
    """
    num_drafts = np.asarray(num_drafts, dtype=np.int64)
    rows_per_req = num_drafts + 1
    row_starts = np.zeros(len(num_drafts) + 1, dtype=np.int64)
    np.cumsum(rows_per_req, out=row_starts[1:])
    draft_req = np.repeat(np.arange(len(num_drafts), dtype=np.int64), num_drafts)
    draft_start = np.zeros(len(num_drafts) + 1, dtype=np.int64)
    np.cumsum(num_drafts, out=draft_start[1:])
    draft_pos = np.arange(int(draft_start[-1]), dtype=np.int64) - draft_start[draft_req]
    return {"row_starts": row_starts, "draft_rows": row_starts[draft_req] + draft_pos,
            "draft_req": draft_req, "draft_pos": draft_pos,
            "row_req": np.repeat(np.arange(len(num_drafts), dtype=np.int64), rows_per_req)}


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
        """List form (tests, tools): drafts as Python lists, results as Python lists."""
        drafts = [list(map(int, d)) for d in draft_token_ids]
        num_drafts = np.array([len(d) for d in drafts], dtype=np.int64)
        flat = torch.tensor([t for d in drafts for t in d], dtype=torch.int64,
                            device=target_logits.device)
        out = self.verify(target_logits, flat, num_drafts, sampling_metadata, draft_probs)
        sampled = out.sampled.tolist()
        counts = out.num_sampled.tolist()
        return RejectionSamplerOutput([row[:n] for row, n in zip(sampled, counts)],
                                      num_drafts.tolist(), out.num_accepted.tolist())

    def verify(self, target_logits: torch.Tensor, draft_tokens: torch.Tensor,
               num_drafts: np.ndarray, sampling_metadata: SamplingMetadata,
               draft_probs: torch.Tensor | None = None,
               layout: dict[str, np.ndarray] | None = None,
               to_device=None) -> DeviceRejectionOutput:
        """Device form: no host sync. draft_tokens [D] (drafts of every request, in row order),
        num_drafts [R] host counts; target_logits [sum(n_i + 1), V]; draft_probs [D, V] or None."""
        md = sampling_metadata
        num_reqs = len(num_drafts)
        if md.num_reqs != num_reqs:
            raise ValueError(f"sampling metadata has {md.num_reqs} rows but {num_reqs} requests "
                             "have draft lists; pass one (possibly empty) draft list per request")
        layout = layout if layout is not None else verification_layout(num_drafts)
        row_starts = layout["row_starts"]
        num_rows = int(row_starts[-1])
        if target_logits.dim() != 2 or target_logits.shape[0] != num_rows:
            raise ValueError(f"target_logits must be [sum(num_drafts + 1)={num_rows}, vocab]; got "
                             f"{tuple(target_logits.shape)}")
        total_drafts = int(layout["draft_rows"].shape[0])
        if draft_tokens.shape[0] != total_drafts:
            raise ValueError(f"draft_tokens has {draft_tokens.shape[0]} entries but the requests "
                             f"verify {total_drafts} drafts")
        if draft_probs is not None and tuple(draft_probs.shape) != (total_drafts, target_logits.shape[1]):
            raise ValueError(f"draft_probs must be [total drafts={total_drafts}, vocab="
                             f"{target_logits.shape[1]}]; got {tuple(draft_probs.shape)}")

        device = target_logits.device
        # Host index arrays -> device (small copies of host data; the runner passes `to_device`
        # staging them through pinned buffers, so the copy never blocks the host).
        if to_device is None:
            def to_device(values, name):
                return torch.from_numpy(np.ascontiguousarray(values)).to(device, non_blocking=True)
        draft_rows = to_device(layout["draft_rows"], "draft_rows")
        draft_tokens = draft_tokens.to(torch.int64)

        greedy_tokens = target_logits.argmax(dim=-1)
        if md.all_greedy:
            accepted = draft_tokens == greedy_tokens[draft_rows]
            emitted = greedy_tokens
        else:
            row_req = to_device(layout["row_req"], "row_req")
            accepted, emitted = self._random_verify(target_logits, md, row_req, row_starts.tolist(),
                                                    draft_rows, draft_tokens, draft_probs)
            if not md.all_random:
                greedy_row = (md.temperature < SAMPLING_EPS)[row_req]
                accepted = torch.where(greedy_row[draft_rows], draft_tokens == greedy_tokens[draft_rows],
                                       accepted)
                emitted = torch.where(greedy_row, greedy_tokens, emitted)

        max_drafts = int(num_drafts.max()) if num_reqs else 0
        draft_req = to_device(layout["draft_req"], "draft_req")
        draft_pos = to_device(layout["draft_pos"], "draft_pos")
        # [R, max_drafts] grids (padding: not accepted / token -1); the accepted prefix length is
        # the number of leading accepted drafts (cumprod of the accept flags).
        accept_grid = torch.zeros(num_reqs, max_drafts, dtype=torch.int64, device=device)
        token_grid = torch.full((num_reqs, max_drafts), -1, dtype=torch.int64, device=device)
        if total_drafts:
            accept_grid[draft_req, draft_pos] = accepted.to(torch.int64)
            token_grid[draft_req, draft_pos] = draft_tokens
        num_accepted = accept_grid.cumprod(dim=1).sum(dim=1)
        starts = to_device(row_starts[:-1], "row_starts")
        emitted_token = emitted[starts + num_accepted]
        col = torch.arange(max_drafts + 1, device=device)
        padded = torch.cat([token_grid, torch.full((num_reqs, 1), -1, dtype=torch.int64,
                                                   device=device)], dim=1)
        sampled = torch.where(col < num_accepted[:, None], padded,
                              torch.where(col == num_accepted[:, None], emitted_token[:, None],
                                          torch.full_like(padded, -1)))
        return DeviceRejectionOutput(sampled, num_accepted, num_accepted + 1)

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
