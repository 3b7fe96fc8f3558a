"""EAGLE: an autoregressive, causal one-layer drafter over [embed(token) ; target hidden state].

Draft KV at position p encodes (token p+1, hidden p). Per engine step:
  * first pass over the step's processed tokens, input ids shifted left by one; the row of the
    last accepted position carries the anchor (bonus/corrected token) and yields draft 1;
  * steps s = 1..k-1: one token per request at position num_computed_new + s - 1, the draft's own
    seq_len = num_computed_new + s. Every engine step starts again from the accepted prefix, which
    is the roll-back: KV the draft wrote for rejected positions is overwritten before it is read.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm.v1.worker.gpu.spec_decode.speculator import DraftInputs, Speculator


class EagleSpeculator(Speculator):
    """Also MTP's speculator: both drafters share the (input_ids, positions, hidden) contract."""

    def _propose(self, inputs: DraftInputs) -> torch.Tensor:
        num_reqs = inputs.num_reqs
        buffers = self.input_buffers
        self._begin_drafts(inputs)
        drafts = torch.empty(num_reqs, self.num_speculative_tokens, dtype=torch.int64,
                             device=self.device)
        if num_reqs == 0:
            return drafts
        num_tokens = int(inputs.query_start_loc_np[num_reqs])
        # First pass: same rows, positions and lengths as the target step, ids shifted by one.
        buffers.input_ids[: num_tokens - 1].copy_(inputs.target_input_ids[1:num_tokens])
        buffers.input_ids[inputs.last_accepted_index] = inputs.next_token_ids
        buffers.positions[:num_tokens].copy_(inputs.target_positions[:num_tokens])
        buffers.seq_lens[:num_reqs].copy_(inputs.target_seq_lens_on_device(self.device))
        target_lens_np = inputs.target_seq_lens_cpu[:num_reqs].numpy()
        attn_metadata = self._build_draft_attn_metadata(
            num_reqs, num_reqs, num_tokens, inputs.target_seq_lens_cpu, step=0, causal=True,
            query_start_loc_np=inputs.query_start_loc_np, seq_lens_np=target_lens_np)
        hidden_for_logits, hidden_for_next = self._run_forward(
            attn_metadata, self.model, buffers.input_ids[:num_tokens],
            buffers.positions[:num_tokens], inputs.target_hidden_states[:num_tokens])
        rows = inputs.last_accepted_index
        drafts[:, 0] = self._choose_drafts(self.model.compute_logits(hidden_for_logits[rows]), 0)
        hidden = hidden_for_next[rows]

        accepted = inputs.accepted_on_device(self.device)
        accepted_np = np.asarray(inputs.num_computed_new, dtype=np.int64)
        for step in range(1, self.num_speculative_tokens):
            # One fused write (a uniform row of one token): id = the previous draft, position
            # num_computed_new + step - 1, the draft's seq_len num_computed_new + step, and the
            # drafter groups' slots. Drafts past max_model_len are dropped by the scheduler; the
            # clamped position keeps their (useless) forward inside the rope and block tables.
            slot_mappings = self._write_uniform_rows(num_reqs, num_reqs, 1, accepted,
                                                     drafts[:, step - 1], start_offset=step - 1)
            attn_metadata = self._build_draft_attn_metadata(
                num_reqs, num_reqs, num_reqs, inputs.target_seq_lens_cpu, step=step,
                num_query_per_req=1, causal=True,
                seq_lens_np=np.minimum(accepted_np + step, self.max_model_len),
                slot_mappings=slot_mappings)
            hidden_for_logits, hidden = self._run_forward(
                attn_metadata, self.model, buffers.input_ids[:num_reqs],
                buffers.positions[:num_reqs], hidden)
            drafts[:, step] = self._choose_drafts(self.model.compute_logits(hidden_for_logits),
                                                  step)
        return drafts
