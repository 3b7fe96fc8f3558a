"""DFlash: block = anchor + N mask tokens, non-causal; the hidden state at mask j predicts the
token AT that position, so the N drafts come from the mask rows. All metadata (DCP-local lengths
included) comes from the shared base builder."""
from __future__ import annotations

import torch

from vllm.v1.worker.gpu.spec_decode.block_speculator import BlockSpeculator
from vllm.v1.worker.gpu.spec_decode.speculator import greedy_draft


class DFlashSpeculator(BlockSpeculator):

    @property
    def query_len(self) -> int:
        return self.num_speculative_tokens + 1

    def select_drafts(self, logits: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        return greedy_draft(logits[:, 1:, :])
