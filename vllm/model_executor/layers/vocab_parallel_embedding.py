"""Vocabulary-parallel embedding and LM head.

The vocabulary is padded up to a multiple of the TP size and split into contiguous ranges; each rank
embeds only its range (others contribute zeros to the all-reduce) and computes logits only for its
range (all-gathered, padding dropped, so every rank sees the full vocabulary).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.parallel_utils import tp_group
from vllm.model_executor.layers.weight_utils import check_full_shape


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        group = tp_group()
        self.tp_size, self.tp_rank = group.world_size, group.rank_in_group
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_padded = -(-num_embeddings // self.tp_size) * self.tp_size
        self.per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start = self.tp_rank * self.per_partition
        self.vocab_end = min(self.vocab_start + self.per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.zeros(self.per_partition, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        check_full_shape(loaded, (self.num_embeddings, self.embedding_dim))
        rows = self.vocab_end - self.vocab_start
        with torch.no_grad():
            param.zero_()
            if rows > 0:
                piece = loaded[self.vocab_start:self.vocab_end]
                param[:rows].copy_(piece.to(dtype=param.dtype, device=param.device))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_range, input_ids - self.vocab_start, torch.zeros_like(input_ids))
        out = F.embedding(local_ids, self.weight) * in_range.unsqueeze(-1).to(self.weight.dtype)
        return tp_group().all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Same sharded [V_local, D] weight; `compute_logits` returns the full [T, V] on every rank."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden_states, self.weight)
        if self.tp_size > 1:
            logits = tp_group().all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not an embedding; call compute_logits(hidden_states)")
