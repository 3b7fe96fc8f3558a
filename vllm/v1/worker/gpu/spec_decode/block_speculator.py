"""Shared machinery of the block drafters (DFlash, DSpark): one non-causal forward per step.

The drafter's layers live in their own non-causal KV cache group. During the target step the
runner hands over the tapped target hidden states so the drafter stores context KV for every
processed position. The block (anchor + masks) sits at positions num_computed_new + arange(Q);
the draft's seq_len is num_computed_new + Q, and its rank-local lengths come from the shared base
builder (no DCP code here). Context KV written for rejected positions is overwritten by the block
(Q >= number of drafts verified) and by the next step's context pass before anything reads it.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm.v1.worker.gpu.spec_decode.speculator import DraftInputs, Speculator


class BlockSpeculator(Speculator):

    @property
    def query_len(self) -> int:
        """Q: tokens in the draft block."""
        raise NotImplementedError

    def select_drafts(self, logits: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """logits [num_reqs, Q, V] of the block -> drafts [num_reqs, num_speculative_tokens]."""
        raise NotImplementedError

    @property
    def aux_hidden_state_layers(self) -> tuple[int, ...]:
        return tuple(int(i) for i in self.model.config.target_layer_ids)

    def precompute_context(self, aux_hidden_states: torch.Tensor | None,
                           positions: torch.Tensor) -> None:
        if aux_hidden_states is None:
            raise ValueError(f"{type(self).__name__} needs the target's hidden states at layers "
                             f"{self.aux_hidden_state_layers}; run the target with them.")
        self.model.precompute_context_kv(aux_hidden_states, positions)

    def propose(self, inputs: DraftInputs) -> torch.Tensor:
        num_reqs, q = inputs.num_reqs, self.query_len
        self._begin_drafts(inputs)
        if num_reqs == 0:
            return torch.empty(0, self.num_speculative_tokens, dtype=torch.int64,
                               device=self.device)
        num_tokens = num_reqs * q
        buffers = self.input_buffers
        accepted = inputs.accepted_on_device(self.device)
        accepted_np = np.asarray(inputs.num_computed_new, dtype=np.int64)
        block_ids = buffers.input_ids[:num_tokens].view(num_reqs, q)
        block_ids.fill_(int(self.model.config.mask_token_id))
        block_ids[:, 0] = inputs.next_token_ids
        offsets = torch.arange(q, dtype=torch.int64, device=self.device)
        # Clamped positions only occur for drafts the scheduler drops at max_model_len.
        buffers.positions[:num_tokens].copy_(
            (accepted[:, None] + offsets).clamp(max=self.max_model_len - 1).flatten())
        buffers.seq_lens[:num_reqs].copy_((accepted + q).clamp(max=self.max_model_len))
        attn_metadata = self._build_draft_attn_metadata(
            num_reqs, num_reqs, num_tokens, inputs.target_seq_lens_cpu, step=q,
            num_query_per_req=q, causal=False,
            seq_lens_np=np.minimum(accepted_np + q, self.max_model_len))
        hidden = self._run_forward(attn_metadata, self.model, buffers.input_ids[:num_tokens],
                                   buffers.positions[:num_tokens])
        logits = self.model.compute_logits(hidden).view(num_reqs, q, -1)
        return self.select_drafts(logits, inputs.next_token_ids)
