"""DFlash: block = anchor + N mask tokens, non-causal; the hidden state at mask j predicts the
token AT that position, so the N drafts come from the mask rows. All metadata (DCP-local lengths
included) comes from the shared base builder."""
from __future__ import annotations

import torch

from vllm.v1.worker.gpu.spec_decode.block_speculator import BlockSpeculator


class DFlashSpeculator(BlockSpeculator):

    @property
    def query_len(self) -> int:
        return self.num_speculative_tokens + 1

    def select_drafts(self, logits: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        mask_rows = range(1, logits.shape[1])
        return torch.stack([self._choose_drafts(logits[:, row, :], row - 1) for row in mask_rows],
                           dim=1)
