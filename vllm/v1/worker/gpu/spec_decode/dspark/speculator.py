"""DSpark: block = anchor + N-1 mask tokens, non-causal; row j predicts the token after it.

A low-rank Markov head adds a bias from the previously chosen token, so drafts are chosen (argmax,
or sampled with draft_sample_method="probabilistic") left to right: tok_0 from
logits_0 + bias(anchor), tok_j from logits_j + bias(tok_{j-1}). Greedy choice on CUDA runs as
one Triton launch where the head is small enough (markov_greedy.py; VLLM_FUSED_MARKOV_DRAFTS=0
keeps the torch ops).
"""
from __future__ import annotations

import torch

from vllm.v1.worker.gpu.spec_decode.block_speculator import BlockSpeculator
from vllm.v1.worker.gpu.spec_decode.dspark import markov_greedy


class DSparkSpeculator(BlockSpeculator):

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # read once, when the speculator is built (an in-process A/B builds one per setting)
        self.fused_markov = markov_greedy.fused_markov_enabled()
        self.markov_bias_table = self.fused_markov and markov_greedy.bias_table_enabled()
        # (the head's bias table and what it was built from: weights (pointer, version), dtype)
        self._bias_table: torch.Tensor | None = None
        self._bias_table_key: tuple | None = None

    @property
    def query_len(self) -> int:
        return self.num_speculative_tokens

    def select_drafts(self, logits: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        # (a model without the head's weights, e.g. a test's stand-in, keeps the torch ops)
        head = getattr(self.model, "markov_head", None)
        if head is not None and markov_greedy.uses_fused_markov(
                self.fused_markov, logits.device.type, self._chooses_greedily(),
                logits.shape[-1], head.w1.weight.shape[1]):
            if self.markov_bias_table and markov_greedy.bias_table_supported(logits.shape[-1]):
                return markov_greedy.markov_table_drafts(logits, anchors,
                                                         self._head_table(head, logits.dtype))
            return markov_greedy.markov_greedy_drafts(logits, anchors, head.w1.weight,
                                                      head.w2.weight)
        drafts = torch.empty(logits.shape[0], logits.shape[1], dtype=torch.int64,
                             device=logits.device)
        previous = anchors
        for j in range(logits.shape[1]):
            biased = logits[:, j, :] + self.model.markov_logits_bias(previous).to(logits.dtype)
            previous = self._choose_drafts(biased, j)
            drafts[:, j] = previous
        return drafts

    def _head_table(self, head, dtype: torch.dtype) -> torch.Tensor:
        """The Markov head's bias table, rebuilt when its weights were replaced or written in
        place (tensor versions) or the logits' dtype changed. Built on the first eager draft
        step, before any capture: a CUDA graph keeps reading the table it was captured with."""
        w1, w2 = head.w1.weight, head.w2.weight
        key = (w1.data_ptr(), w1._version, w2.data_ptr(), w2._version, dtype)
        if key != self._bias_table_key:
            self._bias_table = markov_greedy.markov_bias_table(w1, w2, dtype)
            self._bias_table_key = key
        return self._bias_table
