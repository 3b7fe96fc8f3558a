"""DSpark block drafter: the DFlash MLA drafter (every block position predicts the NEXT token;
block = anchor + N-1 masks) plus a low-rank Markov head, bias(prev) = W2(W1[prev]), that the
speculator adds to each position's logits while sampling left to right."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.weight_utils import default_weight_loader
from vllm.model_executor.models.dflash_mla import DFlashMLAForCausalLM


class MarkovHead(nn.Module):
    """w1.weight [V, r] embeds the previous token; w2.weight [V, r] maps it back to V logits.
    Replicated on every TP rank (r is small), so the bias is full-vocabulary everywhere."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.w1 = nn.Module()
        self.w2 = nn.Module()
        self.w1.weight = nn.Parameter(torch.empty(vocab_size, rank), requires_grad=False)
        self.w2.weight = nn.Parameter(torch.empty(vocab_size, rank), requires_grad=False)
        self.w1.weight.weight_loader = default_weight_loader
        self.w2.weight.weight_loader = default_weight_loader

    def forward(self, prev_token_ids: torch.Tensor) -> torch.Tensor:
        return F.linear(F.embedding(prev_token_ids, self.w1.weight), self.w2.weight)


class DSparkMLAForCausalLM(DFlashMLAForCausalLM):
    method = "dspark"

    def __init__(self, *, vllm_config=None, prefix: str = "", hf_config=None):
        super().__init__(vllm_config=vllm_config, prefix=prefix, hf_config=hf_config)
        # markov_rank / markov_head_type were validated by block_drafter_fields
        self.markov_head = MarkovHead(self.config.vocab_size, self.fields.markov_rank)

    def markov_logits_bias(self, prev_token_ids: torch.Tensor) -> torch.Tensor:
        """prev_token_ids [B] -> [B, V] logit bias."""
        return self.markov_head(prev_token_ids)
