"""Scheduler-side state of one request."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class Request:
    """Tokens, progress and stop settings of one request.

    `num_computed_tokens` counts tokens whose KV is valid in the cache. While running, every token
    but the last sampled one is computed, so a decode step schedules that last token plus drafts.
    After a preemption by recompute, `num_computed_tokens` is 0 and the whole of `all_token_ids`
    (prompt + outputs so far) is prefilled again.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: object
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.time)
    max_tokens: int = 16
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Async scheduling: tokens of steps that were scheduled (and launched) but whose sampled
    # ids have not arrived yet. The scheduler plans with num_tokens + these placeholders.
    num_output_placeholders: int = 0

    def __post_init__(self):
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        # The stop settings the scheduler checks for every sampled token, read once here (the
        # engine hands each request a private copy of its params that nothing changes later).
        params = self.sampling_params
        self.min_tokens = int(getattr(params, "min_tokens", 0) or 0)
        self.ignore_eos = bool(getattr(params, "ignore_eos", False))
        self.stop_token_ids = frozenset(getattr(params, "stop_token_ids", None) or ())

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.get_finished_reason(self.status)
