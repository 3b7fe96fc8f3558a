"""Runner-side request state: a persistent slot per resident request plus its token history.

The slot indexes the persistent block tables; the token history lets the runner feed the last
sampled token (the anchor) of each decode step without the scheduler resending it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class RequestState:
    req_id: str
    slot: int
    token_ids: list[int]            # prompt (+ outputs after a preemption) + tokens sampled here
    num_computed_tokens: int        # tokens whose KV is valid in the cache (set by the scheduler)
    sampling_params: Any = None


class RequestStates:
    def __init__(self, max_num_reqs: int):
        self.max_num_reqs = max_num_reqs
        self._free_slots = list(range(max_num_reqs - 1, -1, -1))  # pop() hands out slot 0 first
        self.by_id: dict[str, RequestState] = {}

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
                             sampling_params)
        self.by_id[req_id] = state
        return state

    def remove(self, req_id: str) -> RequestState | None:
        state = self.by_id.pop(req_id, None)
        if state is not None:
            self._free_slots.append(state.slot)
        return state
