"""What the model runner returns to the engine for one step."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelRunnerOutput:
    """Per-request results, rows parallel to `req_ids`.

    `sampled_token_ids[i]`: the tokens request i gains this step: its accepted drafts followed by one
    bonus/corrected token (a prefill or plain decode gains exactly one token).
    `spec_token_ids[i]`: drafts proposed for the next step (None when speculative decoding is off).
    `num_draft_tokens[i]`: drafts that were verified this step; `num_accepted_tokens[i]`: how many of
    them were accepted (so len(sampled_token_ids[i]) == num_accepted_tokens[i] + 1).
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    spec_token_ids: list[list[int]] | None = None
    num_draft_tokens: list[int] = field(default_factory=list)
    num_accepted_tokens: list[int] = field(default_factory=list)
    # req_id -> LogprobsLists (vllm.v1.sample.logprobs), one entry per token in
    # sampled_token_ids[i], for requests that asked for logprobs; None when none did.
    logprobs: dict | None = None
    # req_id -> LogprobsLists of prompt tokens 1.. (prefill step only), for prompt_logprobs.
    prompt_logprobs: dict | None = None

    @classmethod
    def make_empty(cls) -> ModelRunnerOutput:
        return cls(req_ids=[], sampled_token_ids=[], spec_token_ids=None)
