"""DSpark: block = anchor + N-1 mask tokens, non-causal; row j predicts the token after it.

A low-rank Markov head adds a bias from the previously chosen token, so drafts are chosen (argmax,
or sampled with draft_sample_method="probabilistic") left to right: tok_0 from
logits_0 + bias(anchor), tok_j from logits_j + bias(tok_{j-1}).
"""
from __future__ import annotations

import torch

from vllm.v1.worker.gpu.spec_decode.block_speculator import BlockSpeculator


class DSparkSpeculator(BlockSpeculator):

    @property
    def query_len(self) -> int:
        return self.num_speculative_tokens

    def select_drafts(self, logits: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        drafts = torch.empty(logits.shape[0], logits.shape[1], dtype=torch.int64,
                             device=logits.device)
        previous = anchors
        for j in range(logits.shape[1]):
            biased = logits[:, j, :] + self.model.markov_logits_bias(previous).to(logits.dtype)
            previous = self._choose_drafts(biased, j)
            drafts[:, j] = previous
        return drafts
