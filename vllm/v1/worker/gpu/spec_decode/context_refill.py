"""Draft context refilled on demand instead of written in every plain step (opt-in,
VLLM_DRAFT_CONTEXT_REFILL=1).

A block drafter (DFlash, DSpark) stores the context KV of every token the target processes,
inside every target step. Where the speculation policy has stopped drafting, that write is pure
overhead: at V3-rank dims the drafter's feature projection alone reads a [3 x 7168, 7168] weight
in every plain step (~22 % of the target's per-step weight bytes), and on the tiny model it is
part of the ~7-11 % by which a DSpark engine that cannot pay trails plain decoding (issue #15,
docs/performance.md).

With refill on, a uniform Q = 1 decode step after which nobody drafts (the scheduler's
`propose_drafts` is False) runs the target alone: CUDA graphs captured without the tapped hidden
states and the context-KV write (eager steps skip them the same way). Its rows' draft context is
then stale from their first skipped position (`ContextRefillTracker`, one entry per request
slot). Before a step after which the drafter runs, the runner refills the stale positions of
that step's rows: a target forward over them that taps the hidden states and writes the
drafter's context KV from them, and writes no target KV (its target slots are -1: the target's
own KV of those positions is already in the cache, and rewriting it from another pass would
change its low-order bits and so later greedy tokens). By default its rows are decode rows of
any length (GPUModelRunner.refill_through_decode): the causal multi-token decode kernels read
every position's KV, the refilled ones' included, from the cache; off, they are prefill chunks
with context.

Greedy output never depends on the drafter's context (drafts are verified). The refilled KV is
the same function of the same tokens, computed by multi-token kernels instead of Q = 1 ones,
so its low-order bits may differ from what the plain steps would have written. Prefill chunks and
verify steps always write context KV (a refill would repeat a whole prompt's prefill).

Where it stands (thirty-seventh session, H100, docs/performance.md): exact (greedy tokens equal
writing in every step, graphs and eager, both backends) and the plain steps are cheaper (the
cannot-pay test's median blocks 0.974 / 0.918-0.933 against 0.946-0.950 / 0.885-0.912 writing,
B = 1 / 8 synchronous), but each of the six refills measured cost 345-1,858 plain steps
(~0.2-0.9 s). Fortieth session (H100, scripts/time_context_refill.py): that was Triton
compiling MoE kernel forms for each new size of pass (one kernel, 249-430 ms; now compiled at
start-up, moe_warmup.py); the decode-row refills are exact on the GPU and, once compiled, take
5.4-6.7 ms at B = 1 for 8-1,024 positions and 5.4-22 ms at B = 8. But skipping the write saves
a plain step only 0.012 ms (B = 1) and 0.006 ms (B = 8) there, so a refill pays only at B = 1
after ~560 or more skipped steps (0.54x the saving at 1,024), and never at B = 8 (3.4x at
1,024): it stays off by default.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm.utils.env_flags import switch_flag

ENV_FLAG = "VLLM_DRAFT_CONTEXT_REFILL"
# "nothing stale": larger than any position
_FRESH = np.iinfo(np.int64).max


def refill_enabled() -> bool:
    return switch_flag(ENV_FLAG, False, "plain steps after which nobody drafts skip the block "
                       "drafter's context-KV write; it is refilled before the next draft pass",
                       "write it in every step")


@dataclass(frozen=True)
class RefillPiece:
    """Positions [start, end) of the request in `slot` (a RequestState in `state`) to refill."""

    state: object
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class ContextRefillTracker:
    """Per request slot, the first position whose draft context KV may be stale (`stale_from`;
    _FRESH when none is). The runner owns one; it reads it before a draft pass and writes it
    in every step that skips the context write."""

    def __init__(self, max_num_reqs: int):
        self.stale_from = np.full(max_num_reqs, _FRESH, dtype=np.int64)
        # True once a step skipped the write and until every stale slot was refilled or left:
        # the proposing steps of an engine that drafts in every step check this flag only.
        self.any_stale = False

    def forget(self, slot: int) -> None:
        """A request left its slot (finished, preempted) or a new one took it: nothing stale."""
        self.stale_from[slot] = _FRESH

    def note_skipped(self, slots: np.ndarray, num_computed: np.ndarray) -> None:
        """A step that processed positions [num_computed, ...) of these slots skipped their
        context write: each slot is stale from its earliest skipped position."""
        # (an assignment: out= on a fancy-indexed view would write a copy)
        self.stale_from[slots] = np.minimum(self.stale_from[slots], num_computed)
        self.any_stale = True

    def stale_pieces(self, states) -> list[RefillPiece]:
        """The stale positions of these resident requests (RequestStates), each up to its
        computed count (the positions whose target KV is in the cache)."""
        pieces = []
        for state in states:
            start = int(self.stale_from[state.slot])
            if start < state.num_computed_tokens:
                pieces.append(RefillPiece(state, start, state.num_computed_tokens))
        return pieces

    def refilled(self, pieces: list[RefillPiece]) -> None:
        for piece in pieces:
            self.stale_from[piece.state.slot] = _FRESH
        self.any_stale = bool((self.stale_from != _FRESH).any())


def chunk_pieces(pieces: list[RefillPiece], max_tokens: int, max_rows: int
                 ) -> list[list[RefillPiece]]:
    """Split the refill into forward passes of at most `max_tokens` tokens and `max_rows` rows
    (the runner's batch buffers). A request's positions may be cut into consecutive pieces in
    consecutive passes (a later piece reads the earlier positions' target KV from the cache,
    which the refill never writes). Each pass lists its pieces shortest first: the attention
    builders take rows up to the decode threshold as decode rows, and those must lead (this
    matters with refill_through_decode off; on, every row is a decode row)."""
    if max_tokens < 1 or max_rows < 1:
        raise ValueError(f"max_tokens={max_tokens}, max_rows={max_rows}: both must be >= 1")
    passes: list[list[RefillPiece]] = []
    current: list[RefillPiece] = []
    room = max_tokens
    for piece in pieces:
        start = piece.start
        while start < piece.end:
            if room == 0 or len(current) == max_rows:
                passes.append(current)
                current, room = [], max_tokens
            take = min(room, piece.end - start)
            current.append(RefillPiece(piece.state, start, start + take))
            start += take
            room -= take
    if current:
        passes.append(current)
    return [sorted(p, key=lambda x: x.num_tokens) for p in passes]
