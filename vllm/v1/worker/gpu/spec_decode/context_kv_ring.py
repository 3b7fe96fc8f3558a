"""Deferred context-KV writes of a block drafter (DFlash, DSpark): opt-in,
VLLM_DEFER_DRAFT_CONTEXT_KV=1.

A block drafter stores the context KV of every token the target processes (its layers' latent
KV of the tapped target hidden states), inside every target step, whether or not anybody drafts
after it. In an engine whose policy stops drafting that is pure overhead: on the H200 (tiny
model, B=1, ninth session) +0.05 ms of a 0.7 ms plain step, most of the 10 % by which a DSpark
engine that does not draft trails plain decoding (docs/performance.md).

With the ring, a Q=1 decode step (graph or eager) only appends its tapped hidden states, the
positions and every draft layer's slots to persistent buffers (a few copies in place of the
drafter's projection, norms and rope per layer); the KV is written in one batched pass later:
  * before a draft pass (the drafter reads the context KV),
  * before a step that writes context KV directly (prefill chunks, verify steps), so the ring
    only ever holds the newest tokens,
  * before a step after which blocks were freed (finished or preempted requests: a block can be
    handed to another request, whose own writes must come after the stale ones),
  * when the next append would not fit.
The values written are the same function of the same inputs (one GEMM over many rows instead of
one per step, so low-order bits may differ on some BLAS libraries); greedy output never depends
on them (drafts are verified).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from vllm.utils.env_flags import switch_flag

ENV_FLAG = "VLLM_DEFER_DRAFT_CONTEXT_KV"
DEFAULT_STEPS = 16  # ring capacity in steps of max_num_reqs tokens


def deferral_enabled() -> bool:
    return switch_flag(ENV_FLAG, False, "defer the block drafters' context-KV writes of Q=1 "
                       "steps", "write them in every step")


class DeferredContextKV:
    """Persistent buffers of deferred context rows. `append` is capturable (device-side write
    offset); the host counts the rows (it knows every step's padded token count), so deciding
    to flush needs no sync."""

    def __init__(self, capacity: int, aux_dim: int, num_layers: int, dtype: torch.dtype,
                 device: torch.device | str):
        if capacity < 1:
            raise ValueError(f"capacity={capacity} is invalid: it must be >= 1 tokens")
        self.capacity = int(capacity)
        self.aux = torch.zeros(capacity, aux_dim, dtype=dtype, device=device)
        self.positions = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.slots = torch.full((num_layers, capacity), -1, dtype=torch.int64, device=device)
        self._base = torch.zeros(1, dtype=torch.int64, device=device)  # next free row
        self._arange = torch.arange(capacity, dtype=torch.int64, device=device)
        self.pending = 0  # host: rows appended since the last flush

    def fits(self, num_tokens: int) -> bool:
        return self.pending + num_tokens <= self.capacity

    def append(self, aux: torch.Tensor, positions: torch.Tensor,
               slot_mappings: Sequence[torch.Tensor]) -> None:
        """Rows [base, base + T) <- the step's T tokens; slots past a layer's mapping are -1
        (never written). Device ops only (a graph replays them at a moving offset)."""
        num_tokens = aux.shape[0]
        index = self._base + self._arange[:num_tokens]
        self.aux.index_copy_(0, index, aux)
        self.positions.index_copy_(0, index, positions[:num_tokens])
        for layer, slots in enumerate(slot_mappings):
            rows = self.slots[layer]
            n = min(num_tokens, slots.shape[0])
            rows.index_copy_(0, index[:n], slots[:n])
            if n < num_tokens:
                rows.index_fill_(0, index[n:], -1)
        self._base.add_(num_tokens)

    def note_appended(self, num_tokens: int) -> None:
        """The host's count of a step's append (call once per step that appended)."""
        if self.pending + num_tokens > self.capacity:
            raise RuntimeError(f"deferred context KV overflow: {self.pending} + {num_tokens} rows "
                               f"> capacity {self.capacity}; flush before such a step")
        self.pending += num_tokens

    def flush(self, write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]) -> bool:
        """write(aux [n, D], positions [n], slots [num_layers, n]) of the pending rows, then
        empty the ring. Returns whether anything was written."""
        n = self.pending
        if n == 0:
            return False
        write(self.aux[:n], self.positions[:n], self.slots[:, :n])
        self.reset()
        return True

    def reset(self) -> None:
        """Drop every pending row (also after graph capture, whose dummy steps appended)."""
        self._base.zero_()
        self.pending = 0
