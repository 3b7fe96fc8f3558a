"""What the scheduler hands to the model runner for one engine step.

The runner keeps its own per-request state (block tables, token ids); the scheduler only sends what
changed: whole new requests once, then block-id deltas and computed-token counts for cached ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or saw before it was preempted): prefill all its tokens.

    After a preemption by recompute, `prompt_token_ids` is the original prompt plus every token
    generated so far, and `num_computed_tokens` is 0 again.
    """

    req_id: str
    prompt_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams | None = None


@dataclass
class CachedRequestData:
    """Requests already resident in the runner; rows are parallel lists indexed like `req_ids`.

    `new_block_ids[i]` are block ids appended to request i's table this step (often empty).
    `num_computed_tokens[i]` counts tokens whose KV is valid (rejected drafts excluded).
    """

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @classmethod
    def make_empty(cls) -> CachedRequestData:
        return cls()


@dataclass
class SchedulerOutput:
    """One step's plan.

    `num_scheduled_tokens[req_id]` = 1 + len(drafts) for a running request (the last sampled token
    plus the drafts to verify) or the whole prompt length for a new one.
    `scheduled_spec_decode_tokens[req_id]` lists the drafts to verify this step (absent: none).
    `finished_req_ids` / `preempted_req_ids`: requests whose runner state must be dropped before
    this step runs (finished or aborted since the last step / preempted by recompute this step).
    `propose_drafts`: False when the speculation policy lets no request draft after this step,
    so the runner may skip the draft pass (every row's next step is a plain decode).
    `advanced`: async scheduling advanced the scheduled requests' computed counts (and output
    placeholders) when this step was scheduled, since it verifies no drafts and its counts are
    exact; its output is then applied by the async update. False: a synchronous step (a
    speculative engine's verifying step), applied after it is collected.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    propose_drafts: bool = True
    advanced: bool = False

    @classmethod
    def make_empty(cls) -> SchedulerOutput:
        return cls(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(),
                   num_scheduled_tokens={}, total_num_scheduled_tokens=0)

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)
