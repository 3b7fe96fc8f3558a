"""Per-request latency bookkeeping shared by the server (AsyncLLM) and the offline benchmarks.

One `RequestTimer` follows a request from arrival to its last token. Speculative decoding can emit
several tokens in one engine step; such a burst counts as one inter-token gap spread evenly over its
tokens, which is how TPOT is defined (time after the first token divided by the tokens after it).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class RequestTimer:
    arrival_time: float = field(default_factory=time.perf_counter)
    num_prompt_tokens: int = 0
    first_token_time: float | None = None
    first_scheduled_time: float | None = None  # set by the engine when it first schedules it
    last_token_time: float | None = None
    num_generation_tokens: int = 0
    # One entry per output burst after the first: (seconds since previous burst, tokens in burst).
    bursts: list[tuple[float, int]] = field(default_factory=list)
    # False: no bursts are kept (a timer that only needs TTFT / TPOT / phases, e.g. the engine's
    # own per-request timer, then holds O(1) state instead of one tuple per step).
    keep_bursts: bool = True

    def record_tokens(self, num_new_tokens: int, now: float | None = None) -> None:
        """Record that `num_new_tokens` tokens became visible at `now` (no-op for 0 tokens)."""
        if num_new_tokens <= 0:
            return
        now = time.perf_counter() if now is None else now
        if self.first_token_time is None:
            self.first_token_time = now
        elif self.keep_bursts:
            self.bursts.append((now - self.last_token_time, num_new_tokens))
        self.last_token_time = now
        self.num_generation_tokens += num_new_tokens

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.first_token_time is None or self.num_generation_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        if self.last_token_time is None:
            return None
        return self.last_token_time - self.arrival_time

    def phases(self) -> dict[str, float | None]:
        """Timestamps (perf_counter) for queue / prefill / decode / inference times."""
        return {"arrival_time": self.arrival_time,
                "first_scheduled_time": self.first_scheduled_time,
                "first_token_time": self.first_token_time, "last_token_time": self.last_token_time}

    def inter_token_latencies(self) -> list[float]:
        """Per-token gaps: a burst of k tokens after a gap g contributes k gaps of g/k."""
        gaps: list[float] = []
        for gap, count in self.bursts:
            gaps.extend([gap / count] * count)
        return gaps


def mean_acceptance_length(num_drafts: int, num_accepted_tokens: int) -> float:
    """Tokens gained per verification step: 1 bonus/corrected token + accepted drafts."""
    if num_drafts <= 0:
        return 1.0
    return 1.0 + num_accepted_tokens / num_drafts


def per_position_acceptance(num_drafts: int, accepted_per_position: list[int]) -> list[float]:
    """Fraction of drafts whose token at position i was accepted."""
    if num_drafts <= 0:
        return [0.0 for _ in accepted_per_position]
    return [count / num_drafts for count in accepted_per_position]
