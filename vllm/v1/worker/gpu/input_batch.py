"""Persistent, preallocated per-step input buffers of a model runner (or of a drafter).

Every buffer is allocated once at its maximum size and then only written in place: CUDA graphs
capture their addresses, and attention metadata hands out views of them. Callers slice the live
rows (`[:num_tokens]`, `[:num_reqs + 1]`, ...) and must never rebind the attributes.
"""
from __future__ import annotations

import numpy as np
import torch


class InputBuffers:
    def __init__(self, max_num_reqs: int, max_num_tokens: int, device: torch.device | str):
        if not isinstance(max_num_reqs, int) or max_num_reqs < 1:
            raise ValueError(f"max_num_reqs={max_num_reqs!r} is invalid: it must be an int >= 1.")
        if not isinstance(max_num_tokens, int) or max_num_tokens < 1:
            raise ValueError(
                f"max_num_tokens={max_num_tokens!r} is invalid: it must be an int >= 1.")
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.device = torch.device(device)

        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=self.device)
        # The host twin is filled first (the scheduler's counts live on the host), then copied over.
        self.query_start_loc_np = np.zeros(max_num_reqs + 1, dtype=np.int32)
        self.query_start_loc_cpu = torch.from_numpy(self.query_start_loc_np)  # shares memory
        self.query_start_loc = torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=self.device)
        # Global lengths (context + current query) and the rank-local lengths under DCP.
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=self.device)
        self.dcp_local_seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=self.device)
