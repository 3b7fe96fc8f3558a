"""What the engine returns to users: one RequestOutput per request, one CompletionOutput per sample."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.logprobs import PromptLogprobs, SampleLogprobs


# slots: the engine builds one of each per request per step (cheaper to construct and read).
@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    # While the request runs: a read-only list-like view (vllm/v1/engine/output_views.py), not
    # a copy per step; list(token_ids) gives a list. The last (finished) output holds a list.
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string / token id that ended it
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs (logprobs set)
    logprobs: SampleLogprobs | None = None  # one dict per token (SamplingParams.logprobs set;
    # a read-only view like token_ids while the request runs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: dict | None = None
    prompt_logprobs: PromptLogprobs | None = None  # SamplingParams.prompt_logprobs set
