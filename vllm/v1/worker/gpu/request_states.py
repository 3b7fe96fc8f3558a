"""Runner-side request state, one persistent slot per resident request.

Host side (`RequestState`): the token history (prompt + outputs, for prefill inputs and for the
engine-facing bookkeeping) and the exact number of computed tokens, known on the host after the
one device->host transfer of every step.
Device side (`RequestStates` tensors, indexed by slot): the last sampled token (the next step's
anchor), num_computed_tokens (device twin of the host value) and the drafts proposed for the next
step. Decode inputs are gathered from these on the device, so a decode step never ships token ids
from the host.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm.v1.worker.gpu.buffer_utils import CpuGpuBuffer


@dataclass
class RequestState:
    req_id: str
    slot: int
    token_ids: list[int]            # prompt (+ outputs after a preemption) + tokens sampled here
    num_computed_tokens: int        # tokens whose KV is valid in the cache (exact, host)
    sampling_params: Any = None
    # Tokens given at admission (prompt, + outputs after a preemption): positions below this are
    # fed from the host; the token at a later position was sampled here (device anchor).
    num_prompt_tokens: int = 0


class RequestStates:
    def __init__(self, max_num_reqs: int, device: torch.device | str = "cpu",
                 num_spec_tokens: int = 0):
        self.max_num_reqs = max_num_reqs
        self.device = torch.device(device)
        self._free_slots = list(range(max_num_reqs - 1, -1, -1))  # pop() hands out slot 0 first
        self.by_id: dict[str, RequestState] = {}
        # Slot-indexed device state (+ host twin of num_computed for planners).
        self.num_computed = CpuGpuBuffer(max_num_reqs, dtype=torch.int32, device=self.device)
        # One extra entry past the last slot: the scratch target of CUDA-graph padding rows'
        # writes (graph_sampling.py), so no real slot is ever written by a padding row.
        self.scratch_slot = max_num_reqs
        self.last_sampled = torch.zeros(max_num_reqs + 1, dtype=torch.int64, device=self.device)
        self.draft_tokens = torch.zeros(max_num_reqs, max(num_spec_tokens, 1), dtype=torch.int64,
                                        device=self.device)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.by_id

    def __getitem__(self, req_id: str) -> RequestState:
        state = self.by_id.get(req_id)
        if state is None:
            raise KeyError(f"request {req_id!r} is not resident in the model runner; the scheduler "
                           "must send it as a new request first")
        return state

    def add(self, req_id: str, token_ids: list[int], num_computed_tokens: int,
            sampling_params: Any) -> RequestState:
        if req_id in self.by_id:
            raise ValueError(f"request {req_id!r} is already resident; finish or preempt it first")
        if not self._free_slots:
            raise ValueError(f"no free request slot for {req_id!r}: max_num_seqs="
                             f"{self.max_num_reqs} requests are already resident")
        state = RequestState(req_id, self._free_slots.pop(), list(token_ids), num_computed_tokens,
                             sampling_params, num_prompt_tokens=len(token_ids))
        self.by_id[req_id] = state
        self.num_computed.np[state.slot] = num_computed_tokens
        return state

    def remove(self, req_id: str) -> RequestState | None:
        state = self.by_id.pop(req_id, None)
        if state is not None:
            self._free_slots.append(state.slot)
        return state

    def set_num_computed(self, state: RequestState, value: int) -> None:
        state.num_computed_tokens = int(value)
        self.num_computed.np[state.slot] = int(value)
